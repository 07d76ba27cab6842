# The trainer image's base on the local test node (hack/images.sh): the Debian bookworm base made
# there with debootstrap + PyPI's torch (and numpy, as PyTorch images ship it) in the system Python.
# It stands in for the CUDA PyTorch base of trainer-image/Dockerfile, which no registry here can
# serve. PyPI's Linux torch wheel pulls its nvidia-* wheels (a few GB) even to import on CPU.
#
# hack/images.sh mounts a wheelhouse kept on the host at /wheels (`pip download` skips the files
# already there, so the multi-GB wheels are fetched once) and the host's CA bundle over the
# image's, so pip reaches PyPI the way the host does; neither ends up in the image.
ARG BASE_IMAGE=localhost/kubetrain/base:bookworm
FROM ${BASE_IMAGE}
ARG TORCH_VERSION=2.13.0
ARG NUMPY_VERSION=2.4.6
# Debian's system Python has no pip of its own (venvs get one): a throwaway venv's pip installs into
# /usr/local/lib/python3.11/dist-packages, which the trainer's `venv --system-site-packages` sees.
RUN python -m venv /tmp/pip \
    && /tmp/pip/bin/pip download --progress-bar off --dest /wheels \
       "torch==${TORCH_VERSION}" "numpy==${NUMPY_VERSION}" \
    && /tmp/pip/bin/pip --python /usr/bin/python3 install --no-index --find-links /wheels \
       --break-system-packages --root-user-action=ignore "torch==${TORCH_VERSION}" "numpy==${NUMPY_VERSION}" \
    && rm -rf /tmp/pip \
    && python -c "import numpy, torch; print('torch', torch.__version__, 'numpy', numpy.__version__)"
