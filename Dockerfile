# syntax=docker/dockerfile:1.7
# The GLM-5.3 FP8 serving image for NVIDIA B300 (sm_103a).
#
# `make image` builds it (docker, podman or buildah) and then runs its
# self-test and the arch audit; see docs/image.md. The ARG defaults
# below are the single source of the versions the Dockerfile names; they must
# equal build/pins.toml (tests/image checks it). Every download is checked by
# sha256: the sdists and the CUDA compiler wheels by the build tool
# (build/pins.toml), every Python wheel by pip --require-hashes
# (build/lock/*.txt, written by `make lock` from the same index).
#
# Stages, each named for what it makes:
#   base             the rootfs with the pinned Python, checked
#   build-base       git, g++ and a venv running the project's build tool
#   toolchain        the CUDA 13.0 compiler from the pinned PyPI wheels
#   sources          the pinned sdists, fetched by hash, with patches/ applied
#   build-env        toolchain + torch (CUDA 13) + the wheels' build needs
#   lmcache-wheel    patched LMCache with its CUDA extension for sm_103a
#   flashinfer-wheel patched FlashInfer + its modules compiled ahead of time for sm_103a (with the artifact set)
#   router           the P/D router alone (vllm-router, tini): the chart's router.image
#   runtime          the serving image (the last stage: a build without --target makes it)

# A Debian bookworm rootfs with python3 (3.11) and python3-venv. `make image`
# makes one with debootstrap and passes it by image id; on a builder with
# internet a public image works too, pinned by digest, e.g.
#   --build-arg BASE_IMAGE=docker.io/library/debian:bookworm-slim@sha256:<digest>
# (the base stage then installs python3 and python3-venv from Debian).
ARG BASE_IMAGE=localhost/glm53-base:bookworm
ARG PYTHON_VERSION=3.11
ARG CUDA_VERSION=13.0
ARG TORCH_VERSION=2.13.0
ARG VLLM_VERSION=0.31.0
ARG LMCACHE_VERSION=0.5.5
ARG FLASHINFER_VERSION=0.7.0.post1
ARG NIXL_VERSION=1.4.1
# libfabric for NIXL over EFA: Debian trixie's source package's upstream tarball (pool, by sha256).
ARG LIBFABRIC_VERSION=2.1.0
ARG LIBFABRIC_ORIG_SHA256=1a66369772d5bb151737214af1c478993e969cf298e8f9ed369e7a2ab8d8c6df
# rdma-core (libibverbs, librdmacm, libefa) under libfabric: trixie's source package's upstream
# tarball, the same way. Bookworm's 44 has no EFA RDMA write (libefa v46) and no unsolicited
# write receive (v52), so libfabric's efa provider would emulate every NIXL write.
ARG RDMA_CORE_VERSION=56.1
ARG RDMA_CORE_ORIG_SHA256=63ce7f2baa7242c2dbc76375dac957c420187dd27f8c5e148efc07971ee522a8
# B300 only: LMCache's c_ops as sm_103a SASS; FlashInfer's fused-MoE module the same.
ARG TORCH_CUDA_ARCH_LIST=10.3a
ARG FLASHINFER_CUDA_ARCH_LIST=10.3a
ARG MAX_JOBS=2
# Reproducibility (docs/building.md, "Reproducibility"): `make image` passes the commit time of
# the last change to the build inputs; wheels are zipped with it, apt/useradd stamp with it,
# and the engine clamps every file's mtime to it (podman/buildah --timestamp).
ARG SOURCE_DATE_EPOCH=0

######################## base: the pinned Python, checked ########################
FROM ${BASE_IMAGE} AS base
ARG BASE_IMAGE
ARG PYTHON_VERSION
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
ENV LANG=C.UTF-8 DEBIAN_FRONTEND=noninteractive
COPY build/with-build-ca /usr/local/bin/with-build-ca
# Debian packages at the versions and .deb sha256 of build/lock/debian.txt (`make lock-debian`):
# each stage installs its section with aptpin (which checks every .deb and the installed set).
COPY build/lock/debian.txt /opt/glm53/lock/debian.txt
COPY image/imagectl/aptpin.py /usr/local/lib/glm53/aptpin.py
# A slim public base has no python3: install Debian's (bookworm: 3.11); the
# debootstrap base already carries it. Then refuse any other Python.
# hadolint ignore=DL3008
RUN if ! command -v python3 >/dev/null; then \
      apt-get update -qq && apt-get install -y -qq --no-install-recommends python3 python3-venv ca-certificates \
      && rm -rf /var/lib/apt/lists/*; \
    fi; \
    have="$(python3 -c 'import sys; print("%d.%d" % sys.version_info[:2])' 2>/dev/null || echo none)"; \
    if [ "$have" != "$PYTHON_VERSION" ]; then \
      echo "base image ${BASE_IMAGE}: python3 is ${have}, the pinned Python is ${PYTHON_VERSION} (every image wheel is built for it); use a base with Python ${PYTHON_VERSION}" >&2; \
      exit 1; \
    fi; \
    python3 -c 'import ensurepip, venv' 2>/dev/null \
      || { echo "base image ${BASE_IMAGE}: python3 has no venv/ensurepip (Debian: python3-venv)" >&2; exit 1; }

######################## build-base: the project's build tool ########################
# python3-dev: LMCache's C++/CUDA extensions include Python.h.
FROM base AS build-base
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
ARG SOURCE_DATE_EPOCH
# git, g++, make, python3-dev (build/lock/debian.txt [build-base]).
RUN python3 /usr/local/lib/glm53/aptpin.py install --lock /opt/glm53/lock/debian.txt --stage build-base
# The build stages write no bytecode into their layers (a .pyc records its source's mtime).
RUN python3 -m venv /opt/venv && find /opt/venv -name __pycache__ -prune -exec rm -rf {} +
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONPATH=/src/build \
    DIST_CACHE_DIR=/var/cache/dist \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_INPUT=1 \
    PIP_NO_COMPILE=1 \
    PYTHONDONTWRITEBYTECODE=1
# Only the build tool and the pins: editing anything else under build/ or
# scripts/ must not rebuild the compile stages.
COPY build/distbuild/ /src/build/distbuild/
COPY build/pins.toml /src/build/pins.toml

######################## toolchain: CUDA 13.0 from the pinned wheels ########################
FROM build-base AS toolchain
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
ARG PYTHON_VERSION
ARG CUDA_VERSION
# `distbuild toolchain` fetches the pinned nvcc/cccl/crt/nvvm/cudart wheels by
# sha256 and checks that nvcc says release 13.0.
# The toolchain venv's own pip is installed by ensurepip, which writes timestamped .pyc (a
# build's mtimes): removed (make image-repro found them: the only difference in this stage).
RUN --mount=type=cache,target=/var/cache/dist --mount=type=secret,id=build-ca \
    with-build-ca python -m distbuild --work /work toolchain \
    && find /work/toolchain -name __pycache__ -prune -exec rm -rf {} +
# The wheels put the toolkit under nvidia/cu13 with lib/ (CMake and torch look
# for lib64/) and only versioned libcudart: give the usual names.
RUN ln -s "/work/toolchain/lib/python${PYTHON_VERSION}/site-packages/nvidia/cu13" /opt/cuda \
    && ln -s lib /opt/cuda/lib64 \
    && for so in /opt/cuda/lib/libcudart.so.*; do if [ ! -e /opt/cuda/lib/libcudart.so ]; then ln -s "$(basename "$so")" /opt/cuda/lib/libcudart.so; fi; done \
    && if ! /opt/cuda/bin/nvcc --version | grep -q "release ${CUDA_VERSION}"; then \
         echo "toolchain: /opt/cuda/bin/nvcc is not CUDA ${CUDA_VERSION}" >&2; exit 1; \
       fi
# FlashInfer's JIT links every module with -L$cuda_home/lib64/stubs -lcuda; the wheels carry
# no libcuda stub (the driver brings libcuda.so.1 on the node), so make the toolkit's kind:
# every driver entry point of this cuda.h, SONAME libcuda.so.1, at lib64/stubs only.
COPY image/imagectl/__init__.py image/imagectl/cudastub.py /src/scripts/imagectl/
RUN PYTHONPATH=/src/scripts python -m imagectl.cudastub --cuda-h /opt/cuda/include/cuda.h --out /opt/cuda/lib/stubs/libcuda.so
ENV CUDA_HOME=/opt/cuda PATH=/opt/cuda/bin:$PATH

######################## sources: fetch by hash, apply the series ########################
FROM build-base AS sources
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
COPY patches/ /src/patches/
COPY image/imagectl/__init__.py image/imagectl/treemap.py /src/scripts/imagectl/
# The project's own steps (build/distbuild): sdists by sha256, pristine commit,
# `git am` of each patch with exact context; a patch that does not apply stops
# here naming the patch and hunk. Then a file map of each tree, which the
# runtime self-test compares with what is installed. git's index records each file's
# ctime and inode (different per build); the trees' commits are what later stages read.
RUN --mount=type=cache,target=/var/cache/dist --mount=type=secret,id=build-ca \
    with-build-ca python -m distbuild --work /work patched \
    && PYTHONPATH=/src/scripts python -m imagectl.treemap /work/src /work/trees \
    && cp /work/manifest.json /work/trees/manifest.json \
    && rm -f /work/src/*/.git/index

######################## libfabric: NIXL over EFA ########################
# nixl-cu13 1.4.1 (vLLM 0.31.0's own pin, requirements/kv_connectors.txt) links libfabric at
# FABRIC_1.7; bookworm's libfabric1 is 1.17 (FABRIC_1.5) and its LIBFABRIC backend does not load
# (NIXL_ERR_NOT_FOUND). Debian trixie's libfabric 2.1.0 source, built here on trixie's rdma-core
# 56.1 source (built first, into /opt/rdma-core: libibverbs, librdmacm, libefa and the other
# verbs providers) with the efa, shm, tcp, rxm and verbs providers, and CUDA memory support
# (dlopen of the driver's libcuda and libnvidia-ml, nvml.h from the pinned toolchain): GPUDirect
# RDMA of the KV cache over EFA. The stage fails unless libfabric's efa provider sees EFA's RDMA
# write and unsolicited write receive in rdma-core's efadv.h.
FROM toolchain AS libfabric
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
ARG LIBFABRIC_VERSION
ARG LIBFABRIC_ORIG_SHA256
ARG RDMA_CORE_VERSION
ARG RDMA_CORE_ORIG_SHA256
ARG MAX_JOBS
ARG SOURCE_DATE_EPOCH
# autoconf automake libtool pkg-config cmake libnl-3-dev libnl-route-3-dev xz-utils (build/lock/debian.txt [libfabric]).
RUN python3 /usr/local/lib/glm53/aptpin.py install --lock /opt/glm53/lock/debian.txt --stage libfabric
COPY image/imagectl/debsource.py /src/scripts/imagectl/debsource.py
# No man pages (pandoc), no pyverbs (cython), no static libraries; udev and systemd are only
# for the daemons. The libraries find their providers and drivers under /opt/rdma-core, the
# path the runtime keeps. The build folder goes: CMake's logs in it differ from build to build
# (measured by make image-repro).
WORKDIR /work/rdma-core
RUN --mount=type=cache,target=/var/cache/dist --mount=type=secret,id=build-ca \
    with-build-ca python3 /src/scripts/imagectl/debsource.py --source rdma-core \
      --file "rdma-core_${RDMA_CORE_VERSION}.orig.tar.gz" --sha256 "${RDMA_CORE_ORIG_SHA256}" \
      --cache /var/cache/dist/debian-src --out /work/rdma-core/orig.tar.gz \
    && tar -xzf orig.tar.gz --strip-components=1 && rm orig.tar.gz \
    && cmake -S . -B build -DCMAKE_BUILD_TYPE=Release -DCMAKE_INSTALL_PREFIX=/opt/rdma-core \
         -DCMAKE_INSTALL_LIBDIR=lib -DCMAKE_INSTALL_SYSCONFDIR=/opt/rdma-core/etc \
         -DNO_MAN_PAGES=1 -DNO_PYVERBS=1 -DENABLE_STATIC=0 -DENABLE_RESOLVE_NEIGH=1 >/dev/null \
    && make -C build -j"${MAX_JOBS}" >/dev/null && make -C build install >/dev/null \
    && { grep -q "EFADV_DEVICE_ATTR_CAPS_RDMA_WRITE" /opt/rdma-core/include/infiniband/efadv.h \
         || { echo "rdma-core ${RDMA_CORE_VERSION}: no libefa with EFA RDMA write under /opt/rdma-core" >&2; exit 1; }; } \
    && rm -rf build
WORKDIR /work/libfabric
RUN --mount=type=cache,target=/var/cache/dist --mount=type=secret,id=build-ca \
    with-build-ca python3 /src/scripts/imagectl/debsource.py --source libfabric \
      --file "libfabric_${LIBFABRIC_VERSION}.orig.tar.xz" --sha256 "${LIBFABRIC_ORIG_SHA256}" \
      --cache /var/cache/dist/debian-src --out /work/libfabric/orig.tar.xz \
    && tar -xJf orig.tar.xz --strip-components=1 && rm orig.tar.xz \
    && ./autogen.sh >/dev/null \
    && export C_INCLUDE_PATH=/opt/rdma-core/include LIBRARY_PATH=/opt/rdma-core/lib LD_LIBRARY_PATH=/opt/rdma-core/lib \
    && ./configure --prefix=/opt/libfabric --disable-static --enable-only \
         --enable-efa=yes --enable-shm=yes --enable-tcp=yes --enable-rxm=yes --enable-verbs=yes \
         --with-cuda=/opt/cuda --enable-cuda-dlopen >/dev/null \
    && make -j"${MAX_JOBS}" >/dev/null && make install >/dev/null \
    && rm -rf /opt/libfabric/lib/*.la /opt/libfabric/share \
    && providers="$(LD_LIBRARY_PATH=/opt/libfabric/lib:/opt/rdma-core/lib /opt/libfabric/bin/fi_info -l)" \
    && for p in efa shm tcp ofi_rxm verbs; do \
         printf '%s\n' "$providers" | grep -qx "${p}:" || { echo "libfabric ${LIBFABRIC_VERSION}: provider ${p} not built: ${providers}" >&2; exit 1; }; \
       done \
    && { grep -q '#define HAVE_CUDA 1' config.h || { echo "libfabric ${LIBFABRIC_VERSION}: built without CUDA memory support" >&2; exit 1; }; } \
    && for cap in HAVE_CAPS_RDMA_WRITE HAVE_CAPS_UNSOLICITED_WRITE_RECV; do \
         grep -q "#define ${cap} 1" config.h || { echo "libfabric ${LIBFABRIC_VERSION}: efa provider built without ${cap} (rdma-core ${RDMA_CORE_VERSION})" >&2; exit 1; }; \
       done \
    && mkdir -p /out/lib /out/bin && cp -L /opt/libfabric/lib/libfabric.so.1 /out/lib/ && cp /opt/libfabric/bin/fi_info /out/bin/ \
    && mkdir -p /out-rdma/lib && cp -a /opt/rdma-core/lib/*.so.* /opt/rdma-core/lib/libibverbs /out-rdma/lib/ \
    && mkdir -p /out-rdma/etc /out-rdma/bin && cp -a /opt/rdma-core/etc/libibverbs.d /out-rdma/etc/ \
    && cp /opt/rdma-core/bin/ibv_devices /opt/rdma-core/bin/ibv_devinfo /out-rdma/bin/ \
    && rm -rf autom4te.cache config.log
WORKDIR /

######################## build-env: torch + build needs ########################
FROM toolchain AS build-env
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
COPY build/lock/builder.txt /src/build/lock/builder.txt
# pip's cache lives in a build cache mount (not in a layer): reruns do not
# download torch again, and pip re-checks every cached file's hash.
# hadolint ignore=DL3042
RUN --mount=type=cache,target=/root/.cache/pip --mount=type=secret,id=build-ca \
    with-build-ca pip install --require-hashes --no-deps --no-compile --progress-bar off -r /src/build/lock/builder.txt \
    && pip check

######################## lmcache-wheel: patched LMCache, CUDA ext for sm_103a ########################
FROM build-env AS lmcache-wheel
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
ARG PYTHON_VERSION
ARG LMCACHE_VERSION
ARG TORCH_CUDA_ARCH_LIST
ARG MAX_JOBS
ARG SOURCE_DATE_EPOCH
# cuBLAS headers of CUDA 13.0, the toolchain's release (build/lock/cuda-headers.txt says why).
COPY build/lock/cuda-headers.txt /src/build/lock/cuda-headers.txt
# hadolint ignore=DL3042
RUN --mount=type=cache,target=/root/.cache/pip --mount=type=secret,id=build-ca \
    with-build-ca pip install --require-hashes --no-deps --progress-bar off --target /opt/cuda-headers \
      -r /src/build/lock/cuda-headers.txt
COPY --from=sources /work/src/lmcache /build/lmcache
COPY --from=sources /work/trees/lmcache.json /build/lmcache.json
# CUDA_HOME explicit (found through PATH it resolves the wrong prefix); the
# nvcc wheels lack the cuBLAS/cuSPARSE/cuSOLVER headers torch's headers
# include: cuBLAS 13.0's from above first, then torch's nvidia/cu13/include.
# The version's local part names the patched tree. --discard-all: no local symbols in the
# extension, because nvcc names a unit's static initializer after its temp file
# (_GLOBAL__sub_I_tmpxft_<pid>_..._ac_dec.cudafe1.cpp: ac_dec.cu has a global constructor from
# <iostream>), which made the .so, the wheel and its sha256 differ per build (make image-repro).
# The build tree (objects, ninja's log with its times) does not stay in the stage.
WORKDIR /build/lmcache
RUN tree="$(python -c 'import json; print(json.load(open("/build/lmcache.json"))["patched_tree"][:12])')" \
    && rm -rf .git \
    && export BUILD_WITH_CUDA=1 CUDA_HOME=/opt/cuda TORCH_CUDA_ARCH_LIST MAX_JOBS \
       CPATH="/opt/cuda-headers/nvidia/cu13/include:/opt/venv/lib/python${PYTHON_VERSION}/site-packages/nvidia/cu13/include" \
       SETUPTOOLS_SCM_PRETEND_VERSION="${LMCACHE_VERSION}+glm53.${tree}" \
       LDFLAGS="-Wl,--discard-all" \
    && echo "lmcache-wheel: building ${LMCACHE_VERSION}+glm53.${tree} for TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST} (MAX_JOBS=${MAX_JOBS})" \
    && if ! pip wheel --no-build-isolation --no-deps --progress-bar off -w /out .; then \
         echo "lmcache-wheel: the LMCache CUDA build failed (see the compiler output above)" >&2; exit 1; \
       fi \
    && rm -rf build
WORKDIR /out
RUN sha256sum ./*.whl > SHA256SUMS

######################## flashinfer-wheel: patched FlashInfer + AOT modules ########################
FROM build-env AS flashinfer-wheel
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
ARG FLASHINFER_CUDA_ARCH_LIST
ARG MAX_JOBS
ARG SOURCE_DATE_EPOCH
COPY --from=sources /work/src/flashinfer /build/flashinfer
WORKDIR /build/flashinfer
# FLASHINFER_BUILD_NO_PIP: the env is provisioned, its hooks must not install;
# BUILD_NVEP=0: the NIXL-EP/NCCL-EP backends are not part of this distribution.
RUN rm -rf .git \
    && if ! FLASHINFER_BUILD_NO_PIP=1 BUILD_NVEP=0 BUILD_NIXL_EP=0 BUILD_NCCL_EP=0 pip wheel --no-build-isolation --no-deps --progress-bar off -w /out .; then \
         echo "flashinfer-wheel: building the patched FlashInfer wheel failed" >&2; exit 1; \
       fi
COPY image/imagectl/__init__.py image/imagectl/flashinfer_aot.py /src/scripts/imagectl/
# The FlashInfer modules vLLM uses for GLM-5.3 FP8 on SM103 (the trtllm-gen
# fused MoE, the sparse-MLA FMHA, sampling, all-reduce fusion) compiled for
# sm_103a into /out/aot (the runtime puts it in flashinfer/data/aot/, where
# FlashInfer loads AOT modules from), from the artifact set `make image`
# stages into build/flashinfer-cubins/ (`make flashinfer-artifacts` fetches
# it). imagectl.flashinfer_aot verifies it along FlashInfer's hash chain of
# THIS tree into /out/cubins (the runtime's FLASHINFER_CUBIN_DIR) and builds
# with FLASHINFER_NO_DOWNLOAD. No set: nothing is compiled and
# /out/flashinfer-aot.json says what is missing and what that costs (the
# image records it, the self-test reports it, STRICT=1 fails).
COPY build/flashinfer-cubins/ /build/cubins-in/
WORKDIR /out
RUN --mount=type=secret,id=build-ca pip install --no-cache-dir --no-deps --progress-bar off /out/flashinfer_python-*.whl \
    && FLASHINFER_CUDA_ARCH_LIST="${FLASHINFER_CUDA_ARCH_LIST}" MAX_JOBS="${MAX_JOBS}" CUDA_HOME=/opt/cuda \
       PYTHONPATH=/src/scripts:/src/build python -m imagectl.flashinfer_aot --tree /build/flashinfer \
         --cubins-in /build/cubins-in --out /out --status /out/flashinfer-aot.json \
    && rm -rf /build/cubins-in \
    && sha256sum ./*.whl > SHA256SUMS

######################## router: the P/D router's own image ########################
# vllm-router and its closure (build/lock/router.txt, every line image.txt's own file) under tini,
# without CUDA, torch or vLLM: a router pod pulls this, not the serving image. The chart runs it
# as uid 1000 with a read-only root and the command /usr/bin/tini -- python3 -m
# vllm_router.launch_router, the same as in the serving image.
FROM base AS router
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
ARG SOURCE_DATE_EPOCH
# tini alone of the runtime's section (build/lock/debian.txt [runtime]); vllm-router's Rust
# extension links only libstdc++, libgcc and zlib besides libc, all in the base.
RUN python3 /usr/local/lib/glm53/aptpin.py install --lock /opt/glm53/lock/debian.txt --stage runtime --only tini
COPY build/lock/router.txt /opt/glm53/lock/router.txt
# hadolint ignore=DL3042
RUN --mount=type=cache,target=/root/.cache/pip --mount=type=secret,id=build-ca \
    python3 -m venv /opt/venv && find /opt/venv -name __pycache__ -prune -exec rm -rf {} + \
    && with-build-ca /opt/venv/bin/pip install --require-hashes --no-deps --no-compile --progress-bar off \
         -r /opt/glm53/lock/router.txt \
    && /opt/venv/bin/pip check \
    && PYTHONHASHSEED=0 PYTHONDONTWRITEBYTECODE=1 /opt/venv/bin/python -m compileall -q -f \
         --invalidation-mode unchecked-hash /opt/venv/lib \
    && useradd --no-create-home --uid 1000 --gid 0 --shell /usr/sbin/nologin router
ENV PATH=/opt/venv/bin:$PATH PYTHONDONTWRITEBYTECODE=1
ARG IMAGE_VERSION=dev
ARG IMAGE_REVISION=unknown
ARG IMAGE_CREATED=unknown
ARG IMAGE_SOURCE=unknown
ARG BASE_NAME=unknown
ARG BASE_DIGEST=unknown
LABEL org.opencontainers.image.title="glm53-b300-router" \
      org.opencontainers.image.description="vllm-router for the GLM-5.3 cell's P/D proxy (build/lock/router.txt)" \
      org.opencontainers.image.version="${IMAGE_VERSION}" \
      org.opencontainers.image.revision="${IMAGE_REVISION}" \
      org.opencontainers.image.created="${IMAGE_CREATED}" \
      org.opencontainers.image.source="${IMAGE_SOURCE}" \
      org.opencontainers.image.base.name="${BASE_NAME}" \
      org.opencontainers.image.base.digest="${BASE_DIGEST}" \
      org.opencontainers.image.licenses="Apache-2.0"
USER 1000:0
EXPOSE 8000
ENTRYPOINT ["/usr/bin/tini", "--", "python3", "-m", "vllm_router.launch_router"]
CMD ["--help"]

######################## runtime: the serving image ########################
FROM base AS runtime
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
ARG PYTHON_VERSION
ARG CUDA_VERSION
ARG TORCH_VERSION
ARG VLLM_VERSION
ARG LMCACHE_VERSION
ARG FLASHINFER_VERSION
ARG NIXL_VERSION
ARG TORCH_CUDA_ARCH_LIST
ARG BASE_IMAGE
# The run-time JIT's host side: gcc (Triton's launcher stub), g++ (FlashInfer's
# and DeepGEMM's host code, nvcc's host compiler), python3-dev (Python.h, which
# Triton's stub and FlashInfer's modules include via sysconfig's include dir).
# rdma-core's libraries come from the libfabric stage (below), not from Debian: libibverbs and
# librdmacm link libnl (libnl-3-200, libnl-route-3-200); NIXL's LIBFABRIC plugin also links
# libhwloc.so.15 (libhwloc15).
# gcc g++ libc6-dev python3-dev libnl-3-200 libnl-route-3-200 libhwloc15 libnuma1 ca-certificates tini
# (build/lock/debian.txt [runtime]).
ARG SOURCE_DATE_EPOCH
RUN python3 /usr/local/lib/glm53/aptpin.py install --lock /opt/glm53/lock/debian.txt --stage runtime
# The image's one libfabric and one rdma-core (the libfabric stage: libibverbs, librdmacm, libefa,
# libmlx5 and the other verbs providers, for libfabric and NIXL's bundled UCX): on the loader's
# path, and fi_info, ibv_devices and ibv_devinfo on PATH.
COPY --from=libfabric /out/ /opt/libfabric/
COPY --from=libfabric /out-rdma/ /opt/rdma-core/
RUN printf '%s\n' /opt/libfabric/lib /opt/rdma-core/lib > /etc/ld.so.conf.d/glm53-libfabric.conf \
    && ldconfig && rm -f /var/cache/ldconfig/aux-cache \
    && ln -s /opt/libfabric/bin/fi_info /usr/local/bin/fi_info \
    && ln -s /opt/rdma-core/bin/ibv_devices /opt/rdma-core/bin/ibv_devinfo /usr/local/bin/ \
    && for lib in libfabric libibverbs librdmacm libefa; do \
         [ "$(ldconfig -p | grep -c "${lib}\.so\.1 ")" = 1 ] \
         || { echo "runtime: want exactly one ${lib}.so.1 (/opt): $(ldconfig -p | grep "${lib}")" >&2; exit 1; }; \
       done \
    && { ldd /opt/libfabric/lib/libfabric.so.1 | grep -q '/opt/rdma-core/lib/libefa\.so\.1' \
         || { echo "runtime: libfabric does not load /opt/rdma-core's libefa: $(ldd /opt/libfabric/lib/libfabric.so.1)" >&2; exit 1; }; }
# The venv's own pip: its timestamped .pyc replaced by unchecked-hash ones (PYTHONHASHSEED=0).
# PYTHONDONTWRITEBYTECODE and -f: the venv's distutils-precedence.pth imports _distutils_hack when
# compileall's own interpreter starts, which wrote a timestamped .pyc that compileall then kept
# (measured by make image-repro: the one file of this layer that differed between two builds).
RUN python3 -m venv /opt/venv && find /opt/venv -name __pycache__ -prune -exec rm -rf {} + \
    && PYTHONHASHSEED=0 PYTHONDONTWRITEBYTECODE=1 /opt/venv/bin/python -m compileall -q -f \
         --invalidation-mode unchecked-hash /opt/venv/lib
ENV PATH=/opt/venv/bin:$PATH PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_INPUT=1
COPY build/lock/image.txt /opt/glm53/lock/image.txt
# The closure in layers a registry pulls in parallel and a lock bump re-pulls only in part
# (imagectl/layers.py): NVIDIA libraries, torch, the rest, then vLLM with our wheels (below).
# pip --no-compile, then unchecked-hash .pyc of each layer's own files: the same bytes per build.
COPY image/imagectl/__init__.py image/imagectl/layers.py /opt/glm53/build/imagectl/
RUN python3 /opt/glm53/build/imagectl/layers.py split /opt/glm53/lock/image.txt /opt/glm53/lock/layers
# hadolint ignore=DL3042
RUN --mount=type=cache,target=/root/.cache/pip --mount=type=secret,id=build-ca \
    with-build-ca pip install --require-hashes --no-deps --no-compile --progress-bar off -r /opt/glm53/lock/layers/nvidia.txt \
    && PYTHONHASHSEED=0 PYTHONDONTWRITEBYTECODE=1 PYTHONPATH=/opt/glm53/build python -m imagectl.layers compile --requirements /opt/glm53/lock/layers/nvidia.txt
# hadolint ignore=DL3042
RUN --mount=type=cache,target=/root/.cache/pip --mount=type=secret,id=build-ca \
    with-build-ca pip install --require-hashes --no-deps --no-compile --progress-bar off -r /opt/glm53/lock/layers/torch.txt \
    && PYTHONHASHSEED=0 PYTHONDONTWRITEBYTECODE=1 PYTHONPATH=/opt/glm53/build python -m imagectl.layers compile --requirements /opt/glm53/lock/layers/torch.txt
# hadolint ignore=DL3042
RUN --mount=type=cache,target=/root/.cache/pip --mount=type=secret,id=build-ca \
    with-build-ca pip install --require-hashes --no-deps --no-compile --progress-bar off -r /opt/glm53/lock/layers/rest.txt \
    && PYTHONHASHSEED=0 PYTHONDONTWRITEBYTECODE=1 PYTHONPATH=/opt/glm53/build python -m imagectl.layers compile --requirements /opt/glm53/lock/layers/rest.txt
# The JIT toolchain (FlashInfer, DeepGEMM, Triton): the lock installs the toolchain
# stage's own compiler wheels (nvcc, ptxas, crt, nvvm, CCCL, cuobjdump: the same files
# and sha256 as build/pins.toml, build/distbuild/host/lock.py JIT_TOOLCHAIN) into
# nvidia/cu13, beside the CUDA 13.0 libraries torch brings. /opt/cuda is laid out
# as in the toolchain stage (lib64, libcudart.so), and exactly one nvcc, 13.0, is in it.
RUN cu13="/opt/venv/lib/python${PYTHON_VERSION}/site-packages/nvidia/cu13" \
    && ln -s "$cu13" /opt/cuda \
    && ln -s lib /opt/cuda/lib64 \
    && for so in /opt/cuda/lib/libcudart.so.*; do if [ ! -e /opt/cuda/lib/libcudart.so ]; then ln -s "$(basename "$so")" /opt/cuda/lib/libcudart.so; fi; done \
    && nvccs="$(find /opt/venv -name nvcc -type f | wc -l)" \
    && if [ "$nvccs" != 1 ] || ! /opt/cuda/bin/nvcc --version | grep -q "release ${CUDA_VERSION},"; then \
         echo "runtime: want exactly one nvcc, CUDA ${CUDA_VERSION}, at /opt/cuda/bin; found ${nvccs}: $(find /opt/venv -name nvcc -type f)" >&2; exit 1; \
       fi \
    && for tool in ptxas cuobjdump fatbinary nvlink; do \
         [ -x "/opt/cuda/bin/${tool}" ] || { echo "runtime: /opt/cuda/bin/${tool} missing (JIT needs it)" >&2; exit 1; }; \
       done
# The toolchain stage's link-time libcuda stub (imagectl/cudastub.py): FlashInfer's JIT links -lcuda.
COPY --from=toolchain /work/toolchain/lib/python${PYTHON_VERSION}/site-packages/nvidia/cu13/lib/stubs/libcuda.so \
     /opt/venv/lib/python${PYTHON_VERSION}/site-packages/nvidia/cu13/lib/stubs/libcuda.so
ENV CUDA_HOME=/opt/cuda PATH=/opt/cuda/bin:$PATH
# Our own wheels, checked against the sums their stage wrote, then pip check
# over the whole closure. Only the sums stay in the image (manifest, SBOM).
# pip check may name unmet requirements only on what the lock leaves out on
# purpose ("# left out (not installed: why): name" lines, written by
# build/distbuild/host/lock.py IMAGE_NOT_INSTALLED: nixl's meta package, which vLLM
# imports as nixl._api, requires nixl-cu12 as well; the image is CUDA 13). The
# self-test accepts the same, read from the same lock.
# The last layer: vLLM (and the kernels only it pulls in) with our LMCache and FlashInfer wheels.
# (Not a bind mount from their stages: buildah 1.28 runs such a RUN before the stage it mounts
# has finished, measured here: "sed: can't read lmcache/SHA256SUMS".)
COPY --from=lmcache-wheel /out/ /tmp/wheels/lmcache/
COPY --from=flashinfer-wheel /out/*.whl /out/SHA256SUMS /tmp/wheels/flashinfer/
WORKDIR /tmp/wheels
# hadolint ignore=DL3042
RUN --mount=type=cache,target=/root/.cache/pip --mount=type=secret,id=build-ca \
    sed 's|  \./|  lmcache/|' lmcache/SHA256SUMS > /tmp/all.sums \
    && sed 's|  \./|  flashinfer/|' flashinfer/SHA256SUMS >> /tmp/all.sums \
    && sha256sum -c /tmp/all.sums \
    && with-build-ca pip install --require-hashes --no-deps --no-compile --progress-bar off -r /opt/glm53/lock/layers/vllm.txt \
    && pip install --no-cache-dir --no-deps --no-compile --progress-bar off lmcache/*.whl flashinfer/*.whl \
    && PYTHONHASHSEED=0 PYTHONDONTWRITEBYTECODE=1 PYTHONPATH=/opt/glm53/build python -m imagectl.layers compile \
         --requirements /opt/glm53/lock/layers/vllm.txt lmcache flashinfer-python \
    && { checked="$(pip check 2>&1)" || true; \
         unmet="$(printf '%s\n' "$checked" | grep -vx 'No broken requirements found.' || true)"; \
         sed -n 's/^# left out (not installed: .*): \(.*\)$/^[^ ]+ [^ ]+ requires \1, which is not installed\\.$/p' \
           /opt/glm53/lock/image.txt > /tmp/accepted-unmet; \
         unmet="$(printf '%s\n' "$unmet" | grep -vE -f /tmp/accepted-unmet || true)"; rm -f /tmp/accepted-unmet; \
         if [ -n "$unmet" ]; then echo "runtime: pip check: $unmet" >&2; exit 1; fi; } \
    && mkdir -p /opt/glm53/wheels && cat lmcache/SHA256SUMS flashinfer/SHA256SUMS > /opt/glm53/wheels/SHA256SUMS \
    && rm -rf /tmp/all.sums /tmp/wheels
WORKDIR /
COPY --from=flashinfer-wheel /out/aot/ /opt/venv/lib/python${PYTHON_VERSION}/site-packages/flashinfer/data/aot/
# FlashInfer's artifact set, verified in the flashinfer-wheel stage (empty without one);
# `make image` passes FLASHINFER_CUBIN_DIR=/opt/flashinfer/cubins only when the set is
# complete, else "" (FlashInfer then downloads into /cache at first use).
COPY --from=flashinfer-wheel /out/cubins/ /opt/flashinfer/cubins/
ARG FLASHINFER_CUBIN_DIR=
# VLLM_HAS_FLASHINFER_CUBIN=1 (only with the set; `make image` passes 0 otherwise): vLLM then
# takes the cubins as present instead of probing FlashInfer's store (has_nvidia_artifactory).
ARG VLLM_HAS_FLASHINFER_CUBIN=0
ENV FLASHINFER_CUBIN_DIR=${FLASHINFER_CUBIN_DIR} \
    VLLM_HAS_FLASHINFER_CUBIN=${VLLM_HAS_FLASHINFER_CUBIN}
COPY --from=flashinfer-wheel /out/flashinfer-aot.json /opt/glm53/flashinfer-aot.json
COPY --from=sources /work/trees/ /opt/glm53/trees/
# vLLM's NIXL P/D proxy is not in the wheel: the pinned sdist's copy.
COPY --from=sources /work/src/vllm/tests/v1/kv_connector/nixl_integration/toy_proxy_server.py /opt/glm53/pd-proxy/toy_proxy_server.py
# The role presets, their validator (run by the self-test with this image's
# vLLM and LMCache) and the Kubernetes deployment with its renderer.
COPY configs/ /etc/glm53/
COPY scripts/ image/ /opt/glm53/scripts/
# manifest.json (inputs, patches, tree hashes + the wheels and AOT status of
# this image) and the CycloneDX SBOM of every installed Python package.
RUN PYTHONDONTWRITEBYTECODE=1 PYTHONPATH=/opt/glm53/scripts python -m imagectl.finalize \
      --trees /opt/glm53/trees --wheels /opt/glm53/wheels --aot /opt/glm53/flashinfer-aot.json \
      --manifest /opt/glm53/manifest.json --sbom /opt/glm53/sbom.cdx.json \
    && find /opt/glm53 -name __pycache__ -prune -exec rm -rf {} + \
    && useradd --create-home --uid 1000 --gid 0 --shell /bin/bash serve \
    && mkdir -p /cache \
    && chown -R 1000:0 /cache /home/serve \
    && chmod -R g+rwX /cache /home/serve
# Any UID (OpenShift, --user 1000680000:0) runs with group 0, which owns the caches
# and HOME with the owner's rights; the entrypoint sets USER/LOGNAME (and HOME if
# unusable) for a UID that /etc/passwd does not know (imagectl/identity.py).
ENV HOME=/home/serve \
    HF_HOME=/cache/huggingface \
    XDG_CACHE_HOME=/cache \
    FLASHINFER_WORKSPACE_BASE=/cache \
    TRITON_CACHE_DIR=/cache/triton \
    VLLM_CACHE_ROOT=/cache/vllm \
    TORCHINDUCTOR_CACHE_DIR=/cache/inductor \
    CUDA_CACHE_PATH=/cache/nv/ComputeCache \
    MPLCONFIGDIR=/cache/matplotlib \
    GLM53_HOME=/opt/glm53 \
    PYTHONPATH=/opt/glm53/scripts
ARG PATCH_SERIES_SHA256=unknown
ARG LMCACHE_PATCHED_TREE=unknown
ARG FLASHINFER_PATCHED_TREE=unknown
ARG VLLM_PATCHED_TREE=unknown
ARG FLASHINFER_AOT=unknown
ARG IMAGE_KIND=unknown
# The KV key epoch the entrypoint gives LMCache (imagectl/keyepoch.py, from the trees above).
ARG KV_KEY_EPOCH=unknown
ARG IMAGE_VERSION=dev
ARG IMAGE_REVISION=unknown
ARG IMAGE_CREATED=unknown
ARG IMAGE_SOURCE=unknown
ARG BASE_NAME=unknown
ARG BASE_DIGEST=unknown
# nvidia-container-toolkit refuses to start the container on a driver older than CUDA 13.0, saying so.
ENV NVIDIA_REQUIRE_CUDA="cuda>=${CUDA_VERSION}"
LABEL org.opencontainers.image.title="glm53-b300-serving" \
      org.opencontainers.image.description="vLLM ${VLLM_VERSION} + patched LMCache ${LMCACHE_VERSION} + patched FlashInfer ${FLASHINFER_VERSION} for GLM-5.3 FP8 on NVIDIA B300 (sm_103a)" \
      org.opencontainers.image.version="${IMAGE_VERSION}" \
      org.opencontainers.image.revision="${IMAGE_REVISION}" \
      org.opencontainers.image.created="${IMAGE_CREATED}" \
      org.opencontainers.image.source="${IMAGE_SOURCE}" \
      org.opencontainers.image.base.name="${BASE_NAME}" \
      org.opencontainers.image.base.digest="${BASE_DIGEST}" \
      io.glm53.nvidia-require-cuda="cuda>=${CUDA_VERSION}" \
      org.opencontainers.image.licenses="Apache-2.0" \
      io.glm53.python="${PYTHON_VERSION}" \
      io.glm53.cuda="${CUDA_VERSION}" \
      io.glm53.cuda-arch="${TORCH_CUDA_ARCH_LIST}" \
      io.glm53.torch.version="${TORCH_VERSION}" \
      io.glm53.vllm.version="${VLLM_VERSION}" \
      io.glm53.lmcache.version="${LMCACHE_VERSION}" \
      io.glm53.flashinfer.version="${FLASHINFER_VERSION}" \
      io.glm53.nixl.version="${NIXL_VERSION}" \
      io.glm53.patch-series.sha256="${PATCH_SERIES_SHA256}" \
      io.glm53.lmcache.patched-tree="${LMCACHE_PATCHED_TREE}" \
      io.glm53.flashinfer.patched-tree="${FLASHINFER_PATCHED_TREE}" \
      io.glm53.vllm.patched-tree="${VLLM_PATCHED_TREE}" \
      io.glm53.flashinfer.fused-moe-aot="${FLASHINFER_AOT}" \
      io.glm53.image.kind="${IMAGE_KIND}" \
      io.glm53.kv-key-epoch="${KV_KEY_EPOCH}"
USER 1000:0
WORKDIR /home/serve
EXPOSE 8000
ENTRYPOINT ["/usr/bin/tini", "--", "/opt/glm53/scripts/entrypoint"]
CMD ["--help"]
