"""Fabric profiles: what spec.fabric adds to a worker pod, as each cloud publishes it. Pure.

One function per profile renders a FabricProfile from spec.fabricOptions (the defaults are the ones
the cloud's own docs and manifests use; docs/scheduling.md#fabrics lists what each sets and where it
comes from). builders.worker_pod applies it: resources, env and mounts on the trainer container,
capabilities, annotations, volumes, node selector, and native sidecars (initContainers with
restartPolicy Always, so that a daemon never holds a finished job).

A profile that is not wired on the node does not fail: NCCL falls back to TCP sockets silently.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kubetrain.core.api import EFA_INSTANCE_TYPES, GKE_GPU_NICS, FabricOptions, TrainingJobSpec

# --------------------------------------------------------------------------- Pod Security Standards

POD_SECURITY_LEVELS = ("restricted", "baseline", "privileged")
"""Pod Security Admission's levels (label pod-security.kubernetes.io/enforce), strictest first."""
ADDABLE_CAPABILITIES = {
    "restricted": frozenset({"NET_BIND_SERVICE"}),
    "baseline": frozenset({"AUDIT_WRITE", "CHOWN", "DAC_OVERRIDE", "FOWNER", "FSETID", "KILL", "MKNOD",
                           "NET_BIND_SERVICE", "SETFCAP", "SETGID", "SETPCAP", "SETUID", "SYS_CHROOT"}),
}
"""The capabilities a container may add at each level (the Pod Security Standards); `privileged`: any."""


def pod_security_level(added_capabilities: tuple[str, ...]) -> str:
    """The strictest level that admits the default worker pod when its container adds these capabilities.

    The rest of the default pod (non-root, seccomp RuntimeDefault, no privilege escalation, every
    capability dropped first) passes `restricted`, so the added capabilities alone decide.
    """
    for level in POD_SECURITY_LEVELS[:-1]:
        if set(added_capabilities) <= ADDABLE_CAPABILITIES[level]:
            return level
    return POD_SECURITY_LEVELS[-1]


# --------------------------------------------------------------------------- profiles


@dataclass(frozen=True)
class FabricProfile:
    """What one fabric adds to a worker pod. The user's env and resources.extra win over it."""

    resources: dict[str, str]
    """Requests and limits of the trainer container."""
    env: dict[str, str]
    """Environment of the trainer container (NCCL, libfabric, the plugin's library path)."""
    capabilities: tuple[str, ...] = ()
    """Added to the trainer container (after dropping ALL)."""
    annotations: dict[str, str] = field(default_factory=dict)
    volumes: tuple[dict[str, Any], ...] = ()
    mounts: tuple[dict[str, Any], ...] = ()
    """Volume mounts of the trainer container."""
    sidecars: tuple[dict[str, Any], ...] = ()
    """Native sidecars (initContainers with restartPolicy Always) that run beside the trainer."""
    node_selector: dict[str, str] = field(default_factory=dict)
    default_memory: str | None = None
    """Memory request when resources.memory is unset (the API server refuses hugepages without cpu or memory)."""

    @property
    def pod_security(self) -> str:
        """The Pod Security Admission level a namespace needs to admit this profile's worker pods.

        hostPath volumes are allowed at `privileged` only; a sidecar's capabilities count as the trainer's.
        """
        if any("hostPath" in v for v in self.volumes):
            return POD_SECURITY_LEVELS[-1]
        return pod_security_level(tuple(sorted(self.all_capabilities())))

    def all_capabilities(self) -> frozenset[str]:
        """The capabilities this profile adds, the trainer's and its sidecars': a podTemplate may restate them."""
        return frozenset(self.capabilities).union(
            cap for s in self.sidecars for cap in s.get("securityContext", {}).get("capabilities", {}).get("add", []))


def _rdma_env(opts: FabricOptions) -> dict[str, str]:
    """NCCL over IB verbs (NVIDIA's NCCL environment variables): the HCAs, GPUDirect RDMA, the bootstrap NIC."""
    return {"NCCL_IB_DISABLE": "0", "NCCL_IB_HCA": opts.ib_hca, "NCCL_SOCKET_IFNAME": opts.socket_ifname}


def _infiniband(spec: TrainingJobSpec, opts: FabricOptions) -> FabricProfile:
    """On-prem / generic InfiniBand through NVIDIA's RDMA shared device plugin (Network Operator)."""
    resource = opts.rdma_resource or "rdma/ib"
    env = {**_rdma_env(opts), "NCCL_NET_GDR_LEVEL": "PHB"}
    return FabricProfile({resource: str(opts.rdma_devices)}, env, ("IPC_LOCK",))


def _roce(spec: TrainingJobSpec, opts: FabricOptions) -> FabricProfile:
    """RoCE v2: InfiniBand verbs over Ethernet, plus the GID of the RoCE v2 address and the traffic class."""
    env = {**_rdma_env(opts), "NCCL_IB_GID_INDEX": str(opts.gid_index)}
    if opts.traffic_class is not None:
        env["NCCL_IB_TC"] = str(opts.traffic_class)
    return FabricProfile({opts.rdma_resource or "rdma/roce": str(opts.rdma_devices)}, env, ("IPC_LOCK",))


def _aks_infiniband(spec: TrainingJobSpec, opts: FabricOptions) -> FabricProfile:
    """AKS ND-series: Azure's RDMA shared device plugin resource, and the NCCL settings of Azure's ND images."""
    env = {**_rdma_env(opts), "NCCL_IB_PCI_RELAXED_ORDERING": "1", "NCCL_IGNORE_CPU_AFFINITY": "1",
           "NCCL_NET_GDR_LEVEL": "SYS"}
    if opts.topo_file:
        env["NCCL_TOPO_FILE"] = opts.topo_file
    return FabricProfile({opts.rdma_resource or "rdma/shared_ib": str(opts.rdma_devices)}, env, ("IPC_LOCK",))


EFA_RESOURCE = "vpc.amazonaws.com/efa"
EFA_DEFAULT_DEVICES = EFA_INSTANCE_TYPES["p5.48xlarge"]
EFA_HUGEPAGES = "5120Mi"
"""EC2 instances with the EFA driver pre-allocate 5128 2 MiB huge pages; the EKS guide's pods request 5120Mi."""
EFA_DEFAULT_MEMORY = "32000Mi"
INSTANCE_TYPE_LABEL = "node.kubernetes.io/instance-type"


def _efa(spec: TrainingJobSpec, opts: FabricOptions) -> FabricProfile:
    """EKS: the EFA device plugin's devices, huge pages, libfabric's EFA provider with GPUDirect RDMA.

    NCCL reaches EFA only through the aws-ofi-nccl plugin, which the image must carry (AWS's DLCs do).
    """
    devices = EFA_INSTANCE_TYPES[opts.instance_type] if opts.instance_type else EFA_DEFAULT_DEVICES
    env = {"FI_PROVIDER": "efa", "FI_EFA_USE_DEVICE_RDMA": "1", "NCCL_BUFFSIZE": "8388608",
           "NCCL_P2P_NET_CHUNKSIZE": "524288"}
    selector = {INSTANCE_TYPE_LABEL: opts.instance_type} if opts.instance_type else {}
    return FabricProfile({EFA_RESOURCE: str(devices), "hugepages-2Mi": EFA_HUGEPAGES}, env, ("IPC_LOCK",),
                         node_selector=selector, default_memory=EFA_DEFAULT_MEMORY)


# GKE A3: GoogleCloudPlatform/container-engine-accelerators gpudirect-tcpx/ and gpudirect-tcpxo/.
TCPX_DAEMON_IMAGE = "us-docker.pkg.dev/gce-ai-infra/gpudirect-tcpx/tcpgpudmarxd-dev:v2.0.12"
TCPXO_DAEMON_IMAGE = "us-docker.pkg.dev/gce-ai-infra/gpudirect-tcpxo/tcpgpudmarxd-dev:v1.0.9"
NVIDIA_LIB = "/usr/local/nvidia/lib64"
"""Where GKE's NCCL plugin installer DaemonSet puts the plugin (host /home/kubernetes/bin/nvidia/lib64)."""
TCPX_SOCKET_DIR = "/run/tcpx"
GKE_GPUS = 8
"""The receive-datapath manager needs every GPU of the A3 node, whatever the pod's GPU count."""


def _gke_annotations(daemon: str, networks: list[str], extra_devices: tuple[str, ...]) -> dict[str, str]:
    """Multi-NIC (eth0 on the default network, eth1.. on the GPU networks) and the daemon's GPU devices."""
    interfaces = [{"interfaceName": "eth0", "network": "default"}] + [
        {"interfaceName": f"eth{i}", "network": net} for i, net in enumerate(networks, start=1)]
    devices = [f"/dev/nvidia{i}" for i in range(GKE_GPUS)] + ["/dev/nvidiactl", "/dev/nvidia-uvm", *extra_devices]
    return {
        "networking.gke.io/default-interface": "eth0",
        "networking.gke.io/interfaces": json.dumps(interfaces),
        f"devices.gke.io/container.{daemon}": "".join(f"- path: {d}\n" for d in devices),
    }


def _host_volumes(*pairs: tuple[str, str]) -> tuple[dict[str, Any], ...]:
    return tuple({"name": name, "hostPath": {"path": path}} for name, path in pairs)


def _daemon(name: str, image: str, command: list[str], mounts: list[dict[str, Any]],
            capabilities: list[str]) -> dict[str, Any]:
    """The receive-datapath manager as a native sidecar: same network namespace as the trainer, ends with it."""
    return {
        "name": name,
        "image": image,
        "restartPolicy": "Always",
        "command": command,
        "env": [{"name": "LD_LIBRARY_PATH", "value": NVIDIA_LIB}],
        "volumeMounts": [{"name": "nvidia-lib", "mountPath": NVIDIA_LIB, "readOnly": True},
                         {"name": "sys", "mountPath": "/hostsysfs"},
                         {"name": "proc-sys", "mountPath": "/hostprocsysfs"}, *mounts],
        # The daemon image runs as root: the pod's runAsNonRoot is for the trainer.
        "securityContext": {"runAsNonRoot": False, "runAsUser": 0, "capabilities": {"add": capabilities}},
    }


def _networks(fabric: str, opts: FabricOptions) -> list[str]:
    return list(opts.gpu_networks or [f"vpc{i}" for i in range(1, GKE_GPU_NICS[fabric] + 1)])


def _tcpx(spec: TrainingJobSpec, opts: FabricOptions) -> FabricProfile:
    """GKE A3 High (a3-highgpu-8g), GPUDirect-TCPX: the tcpx-daemon sidecar, 4 GPU NICs, the TCPX NCCL plugin."""
    networks = _networks("tcpx", opts)
    gpu_nics = ",".join(f"eth{i}" for i in range(1, len(networks) + 1))
    command = ["/tcpgpudmarxd/build/app/tcpgpudmarxd", "--gpu_nic_preset", "a3vm", "--gpu_shmem_type", "fd",
               "--uds_path", TCPX_SOCKET_DIR, "--setup_param", "--verbose 128 2 0 "]
    socket = {"name": "tcpx-socket", "mountPath": TCPX_SOCKET_DIR}
    daemon = _daemon("tcpx-daemon", opts.daemon_image or TCPX_DAEMON_IMAGE, command, [socket], ["NET_ADMIN"])
    env = {
        "LD_LIBRARY_PATH": NVIDIA_LIB, "NCCL_SOCKET_IFNAME": opts.socket_ifname, "NCCL_CROSS_NIC": "0",
        "NCCL_ALGO": "Ring", "NCCL_PROTO": "Simple", "NCCL_NSOCKS_PERTHREAD": "4", "NCCL_SOCKET_NTHREADS": "1",
        "NCCL_NET_GDR_LEVEL": "PIX", "NCCL_P2P_PXN_LEVEL": "0", "NCCL_MAX_NCHANNELS": "8",
        "NCCL_MIN_NCHANNELS": "8", "NCCL_DYNAMIC_CHUNK_SIZE": "524288", "NCCL_P2P_NET_CHUNKSIZE": "524288",
        "NCCL_P2P_PCI_CHUNKSIZE": "524288", "NCCL_P2P_NVL_CHUNKSIZE": "1048576", "NCCL_BUFFSIZE": "4194304",
        "NCCL_GPUDIRECTTCPX_SOCKET_IFNAME": gpu_nics, "NCCL_GPUDIRECTTCPX_CTRL_DEV": opts.socket_ifname,
        "NCCL_GPUDIRECTTCPX_TX_BINDINGS": "eth1:8-21,112-125;eth2:8-21,112-125;eth3:60-73,164-177;"
                                          "eth4:60-73,164-177",
        "NCCL_GPUDIRECTTCPX_RX_BINDINGS": "eth1:22-35,124-139;eth2:22-35,124-139;eth3:74-87,178-191;"
                                          "eth4:74-87,178-191",
        "NCCL_GPUDIRECTTCPX_PROGRAM_FLOW_STEERING_WAIT_MICROS": "500000",
        "NCCL_GPUDIRECTTCPX_FORCE_ACK": "0", "NCCL_GPUDIRECTTCPX_TX_COMPLETION_NANOSLEEP": "1000",
        "NCCL_GPUDIRECTTCPX_UNIX_CLIENT_PREFIX": TCPX_SOCKET_DIR,
    }
    volumes = (*_host_volumes(("nvidia-lib", "/home/kubernetes/bin/nvidia/lib64"), ("sys", "/sys"),
                              ("proc-sys", "/proc/sys")), {"name": "tcpx-socket", "emptyDir": {}})
    mounts = ({"name": "nvidia-lib", "mountPath": NVIDIA_LIB, "readOnly": True}, socket)
    return FabricProfile({}, env, ("IPC_LOCK",), _gke_annotations("tcpx-daemon", networks, ()), volumes, mounts,
                         (daemon,))


def _tcpxo(spec: TrainingJobSpec, opts: FabricOptions) -> FabricProfile:
    """GKE A3 Mega (a3-megagpu-8g), GPUDirect-TCPXO: the tcpxo-daemon sidecar, 8 GPU NICs, the FasTrak plugin."""
    networks = _networks("tcpxo", opts)
    gpu_nics = ",".join(f"eth{i}" for i in range(1, len(networks) + 1))
    command = ["/bin/sh", "-c", "chmod 755 /fts/entrypoint_rxdm_container.sh && exec "
               f"/fts/entrypoint_rxdm_container.sh --num_hops=2 --num_nics={len(networks)} --uid= --alsologtostderr"]
    daemon = _daemon("tcpxo-daemon", opts.daemon_image or TCPXO_DAEMON_IMAGE, command, [],
                     ["NET_ADMIN", "NET_BIND_SERVICE"])
    # nccl-env-profile.sh, the environment GKE's TCPXO plugin installer ships beside the plugin.
    env = {
        "LD_LIBRARY_PATH": NVIDIA_LIB, "NCCL_FASTRAK_LLCM_DEVICE_DIRECTORY": "/dev/aperture_devices",
        "NCCL_FASTRAK_IFNAME": gpu_nics, "NCCL_FASTRAK_CTRL_DEV": opts.socket_ifname,
        "NCCL_SOCKET_IFNAME": opts.socket_ifname, "NCCL_CROSS_NIC": "0", "NCCL_PROTO": "Simple,LL128",
        "NCCL_MIN_NCHANNELS": "4", "NCCL_NVLSTREE_MAX_CHUNKSIZE": "131072", "NCCL_P2P_NET_CHUNKSIZE": "524288",
        "NCCL_P2P_PCI_CHUNKSIZE": "524288", "NCCL_P2P_NVL_CHUNKSIZE": "1048576", "NCCL_FASTRAK_NUM_FLOWS": "2",
        "NCCL_FASTRAK_ENABLE_CONTROL_CHANNEL": "0", "NCCL_BUFFSIZE": "8388608", "NCCL_FASTRAK_USE_SNAP": "1",
        "NCCL_FASTRAK_USE_LLCM": "1", "NCCL_NET_GDR_LEVEL": "PIX", "NCCL_FASTRAK_ENABLE_HOTPATH_LOGGING": "0",
        "NCCL_TUNER_PLUGIN": "libnccl-tuner.so",
        "NCCL_TUNER_CONFIG_PATH": f"{NVIDIA_LIB}/a3plus_tuner_config.textproto",
        "NCCL_SHIMNET_GUEST_CONFIG_CHECKER_CONFIG_FILE": f"{NVIDIA_LIB}/a3plus_guest_config.textproto",
        "NCCL_FASTRAK_PLUGIN_ACCEPT_TIMEOUT_MS": "600000",
    }
    volumes = _host_volumes(("nvidia-lib", "/home/kubernetes/bin/nvidia/lib64"), ("sys", "/sys"),
                            ("proc-sys", "/proc/sys"), ("aperture-devices", "/dev/aperture_devices"))
    mounts = ({"name": "nvidia-lib", "mountPath": NVIDIA_LIB, "readOnly": True},
              {"name": "aperture-devices", "mountPath": "/dev/aperture_devices"})
    annotations = _gke_annotations("tcpxo-daemon", networks, ("/dev/dmabuf_import_helper",))
    return FabricProfile({}, env, (), annotations, volumes, mounts, (daemon,))


def _none(spec: TrainingJobSpec, opts: FabricOptions) -> FabricProfile:
    return FabricProfile({}, {})


RENDERERS: dict[str, Callable[[TrainingJobSpec, FabricOptions], FabricProfile]] = {
    "none": _none, "infiniband": _infiniband, "roce": _roce, "efa": _efa, "tcpx": _tcpx, "tcpxo": _tcpxo,
    "aks-infiniband": _aks_infiniband,
}


def profile(spec: TrainingJobSpec) -> FabricProfile:
    """The profile of spec.fabric with spec.fabricOptions (unset: the cloud's published defaults)."""
    return RENDERERS[spec.fabric](spec, spec.fabric_options or FabricOptions())


FABRICS: dict[str, FabricProfile] = {name: profile(TrainingJobSpec(fabric=name)) for name in RENDERERS}
"""Every profile with its default options (its Pod Security level, the docs' table)."""
