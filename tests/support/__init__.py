"""Helpers shared by the tests (tests/unit, tests/e2e, tests/integration) and the benchmarks (bench/).

Imported as ``support`` (``from support.waiting import wait_for``), with no sys.path edits anywhere:

- pytest: ``pythonpath = ["tests", "bench"]`` in pyproject.toml's [tool.pytest.ini_options] puts
  tests/ (so this package) and bench/ (for compare_lib) on sys.path before any test or conftest loads.
- bench scripts, run as ``.venv/bin/python bench/X.py``: Python puts the script's own directory,
  bench/, first on sys.path, and bench/support is a symbolic link to this directory. The same
  ``from support... import`` works there with no environment variable, .pth file, install or
  ``python -m``; the files exist once (the link is not a copy).

Not chosen: an installed package or a .pth file (changes the venv), PYTHONPATH from the Makefile
(``python bench/X.py`` alone would fail), running bench as modules, and loading files by path with
importlib in every script (a sys.path edit in disguise, and the imports after it out of order).

Modules, one concern each:

- paths: where things are in the repository.
- ports: free loopback ports.
- waiting: ``wait_for`` (poll until truthy, fail naming what was awaited).
- processes: run a tool and check its exit; stop or kill a child process (or its process group).
- cluster: the hack/ control plane: its directories, kubeconfig, up/down/running, an admin client.
- kubectl: the pinned kubectl, run against that cluster.
- identities: token and impersonating clients, ServiceAccount logins, token kubeconfigs.
- resources: server-side apply, delete, wait until gone, CRDs Established, namespaces ready for pods.
- kwok: kwok nodes and pods: fail/succeed a pod, NotReady nodes, jobs whose pods land on kwok.
- pods: a pod's phase and exit codes.
- jobs: TrainingJobs of a namespace and waiting on their status.
- operator_process: the operator as a child process.
- helm_tool, helm_rbac, helm_image: helm and the chart, the chart's RBAC as a login, the images.
- prom_server: a real Prometheus.
- objectstore: a real S3-compatible object store (S3Proxy), behind the ``object_store`` fixture
  (tests/conftest.py).
- real_pods: jobs on the test cluster's real node.
- trainer_harness: gangs of trainer processes and the ``kubetrain`` CLI.
- fake_api: the API groups the operator's applier calls, faked, every call recorded (unit tests).
- process_group: a one-process gloo group for in-process trainer tests.

Scripts that tests run as programs stay beside those tests (tests/e2e/ddp_script.py, script_worker.py).
"""
