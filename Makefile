# Thin front door over the build tool (build/distbuild). Every output goes
# under work/ (override with WORK=...). `make help` lists the targets.

PYTHON ?= python3
WORK ?= $(CURDIR)/work
DIST := PYTHONPATH=$(CURDIR)/build $(PYTHON) -m distbuild --work $(WORK)
FORCE_FLAG := $(if $(filter 1 yes true,$(FORCE)),--force,)

.PHONY: help gpu-bundles gpu-rehearsal image image-check image-repro lock-debian lock lock-test test stress sources fetch flashinfer-artifacts patched export health forward probe-vllm manifest lint pin audit chart picture clean

help: ## list the targets
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | sed -E 's/:.*## /\t/' | awk -F'\t' '{printf "  make %-14s %s\n", $$1, $$2}'
	@echo "  variables: UPSTREAM=lmcache|flashinfer|vllm (export), UPSTREAM=NAME==VERSION (health, forward), FORCE=1, WORK=dir"

IMAGE_TAG ?= localhost/glm53-b300-serving:dev
# The P/D router's own image, built by make image beside the serving image with its version.
ROUTER_TAG ?= localhost/glm53-b300-router:$(lastword $(subst :, ,$(IMAGE_TAG)))
# RELEASE=1 (STRICT=1 is the same): fail unless the image carries FlashInfer's artifact set.
RELEASE_FLAG := $(if $(filter 1 yes true,$(RELEASE) $(STRICT)),--release,)
image: ## build the serving image, run its self-test and the sm_103 audit [ENGINE=docker|podman|buildah] [IMAGE_TAG=..] [BASE_IMAGE=..] [STAGE=..] [RELEASE=1: fail without FlashInfer's artifact set]
	$(DIST) image --tag $(IMAGE_TAG) $(if $(ENGINE),--engine $(ENGINE)) $(if $(BASE_IMAGE),--base-image $(BASE_IMAGE)) $(if $(STAGE),--target $(STAGE)) $(RELEASE_FLAG)

image-repro: ## build the image twice on clean storage, compare every stage's digest, list differing files per layer [STAGE=..]
	$(DIST) image --repro --tag $(IMAGE_TAG) $(if $(ENGINE),--engine $(ENGINE)) $(if $(STAGE),--target $(STAGE))

lock-debian: ## re-resolve build/lock/debian.txt (exact versions + .deb sha256 of every stage) from the live Debian suites
	$(DIST) image --lock-debian $(if $(ENGINE),--engine $(ENGINE))

image-check: ## run the built image: self-test, presets, deployment, the operator tools against real Valkey and a streaming server [IMAGE_TAG=..]
	@test -x $(WORK)/venv/bin/python || { echo "make image-check: needs the test environment ($(WORK)/venv): run make test once" >&2; exit 2; }
	DIST_RUNTIME_IMAGE=$(IMAGE_TAG) DIST_ROUTER_IMAGE=$(ROUTER_TAG) DIST_HELM=$(WORK)/tools/bin/helm $(WORK)/venv/bin/python -m pytest -p no:cacheprovider -v tests/image/test_runtime_image.py tests/image/test_router_image.py

lock: ## resolve the image's Python dependency closure by sha256 into build/lock/{image,builder,router}.txt [ROUTER_ONLY=1: router.txt alone, within image.txt]
	$(DIST) lock $(if $(filter 1,$(ROUTER_ONLY)),--router-only)

lock-test: ## re-resolve build/lock/test-venv.txt and test-engine.txt (the versions make test's two venvs install) from the live index
	$(DIST) lock --test

test: ## the CPU test suite: tool tests, patch proofs on pristine and patched LMCache, peer suite [TEST_ARGS=--no-engine ..]
	$(DIST) test $(TEST_ARGS)

stress: ## make test's phases with busy loops beside them; lists every test whose result changed from the last idle make test [HOG=1] [TEST_ARGS=..]
	$(DIST) test --hog $(or $(HOG),1) $(TEST_ARGS)

gpu-bundles: ## make and stamp the bundles a GPU machine without the trees runs the GPU checks from (tests/device_run.sh)
	$(DIST) gpu-bundles

gpu-rehearsal: ## rehearse the GPU call here on the CPU: bundles, a Python 3.12/torch 2.11 like the GPU host's, no index [HOST_PYTHON=python3.12] [TORCH_INDEX=url] [OUTER_S=600] [ACTIVATION_ARCH=sm_90a|none]
	$(DIST) gpu-rehearsal $(if $(HOST_PYTHON),--host-python $(HOST_PYTHON)) $(if $(TORCH_INDEX),--torch-index $(TORCH_INDEX)) $(if $(OUTER_S),--outer-limit $(OUTER_S)) $(if $(ACTIVATION_ARCH),--activation-arch $(ACTIVATION_ARCH))

sources: ## fetch the pinned upstream sdists into work/cache (verified by sha256)
	$(DIST) sources

fetch: ## fetch every pinned artifact, image wheels and toolchain included (ROLE=upstream|image|toolchain)
	$(DIST) fetch --role $(or $(ROLE),all)

flashinfer-artifacts: ## fetch FlashInfer's pinned trtllm-gen artifacts into the cache, hash-chain verified [FLASHINFER_MIRROR=url|folder] [CHECK=1]
	$(DIST) flashinfer-artifacts $(if $(FLASHINFER_MIRROR),--mirror $(FLASHINFER_MIRROR)) $(if $(filter 1,$(CHECK)),--check)

patched: ## pristine + patched trees under work/src, and work/manifest.json
	$(DIST) patched $(FORCE_FLAG)

export: ## regenerate patches/$(UPSTREAM) from the commits in work/src/$(UPSTREAM) [IDENTITY="Name <email>": author and sign off every patch]
	@test -n "$(UPSTREAM)" || { echo "make export: set UPSTREAM=lmcache|flashinfer|vllm" >&2; exit 2; }
	$(DIST) export $(UPSTREAM) $(if $(IDENTITY),--identity "$(IDENTITY)")

health: ## try the series against another release, e.g. make health UPSTREAM=lmcache==0.5.6
	@test -n "$(UPSTREAM)" || { echo "make health: set UPSTREAM=NAME==VERSION, e.g. lmcache==0.5.6" >&2; exit 2; }
	$(DIST) health $(UPSTREAM)

forward: ## check the series exactly on a newer release pinned in build/forward.toml, and FlashInfer's kernel or LMCache's proofs, CPU suite and engine scenarios there: make forward UPSTREAM=flashinfer==0.7.4 [OFFSETS=1] [BUNDLE=1] [TEST_PYTHON=..]; make forward UPSTREAM=lmcache==0.5.6 [PROOFS=0] [SUITE=0] [ENGINE=0]
	@test -n "$(UPSTREAM)" || { echo "make forward: set UPSTREAM=NAME==VERSION, e.g. flashinfer==0.7.4 or lmcache==0.5.6 (pinned in build/forward.toml)" >&2; exit 2; }
	$(DIST) forward $(UPSTREAM) $(if $(filter 1,$(OFFSETS)),--allow-offsets) $(if $(filter 1,$(BUNDLE)),--bundle) $(if $(TEST_PYTHON),--test-python $(TEST_PYTHON)) $(if $(filter 0,$(PROOFS)),--no-proofs) $(if $(filter 0,$(SUITE)),--no-suite) $(if $(filter 0,$(ENGINE)),--no-engine)

probe-vllm: ## what the presets, the CPU overlay and LMCache's adapter meet on another vLLM: make probe-vllm VERSION=0.34.0 [WHEEL_ONLY=1] [NO_ENGINE=1]
	@test -n "$(VERSION)" || { echo "make probe-vllm: set VERSION=<vLLM release>, e.g. VERSION=0.34.0" >&2; exit 2; }
	$(DIST) probe-vllm $(VERSION) $(if $(filter 1,$(WHEEL_ONLY)),--wheel-only) $(if $(filter 1,$(NO_ENGINE)),--no-engine)

manifest: ## rewrite work/manifest.json
	$(DIST) manifest

lint: ## check the lock file, the patches' DEP-3 / Signed-off-by headers, ruff, and the series' upstream import order
	$(DIST) lint

pin: ## add or refresh a pin: make pin SPEC=name==ver FILE=file ROLE=image [WRITE=1]; make pin REFRESH=1
	$(DIST) pin $(SPEC) $(if $(FILE),--file $(FILE)) $(if $(ROLE),--role $(ROLE)) $(if $(filter 1,$(REFRESH)),--refresh) $(if $(filter 1,$(WRITE)),--write)

TARGET_ARG := $(if $(TARGET),--target $(TARGET),)
audit: ## arch audit gate: make audit AUDIT_PATH=dir|file|oci-archive [TARGET=sm_103] [ALLOWLIST=f] [JSON=out]
	@test -n "$(AUDIT_PATH)" || { echo "make audit: set AUDIT_PATH=a folder, a .so/.cubin/.fatbin, an OCI layout folder or an oci-archive tar" >&2; exit 2; }
	$(DIST) audit $(TARGET_ARG) $(if $(ALLOWLIST),--allowlist $(ALLOWLIST)) $(if $(JSON),--json $(JSON)) $(AUDIT_PATH)

chart: ## package the Helm chart self-contained (links resolved) into work/chart, check it renders as the source, print its sha256
	PYTHONPATH=$(CURDIR)/build $(PYTHON) -m distbuild.host.chart --work $(WORK)

picture: ## draw docs/dataflow.svg from its text source docs/dataflow.dot (needs Graphviz's dot)
	PYTHONPATH=$(CURDIR)/build $(PYTHON) -m distbuild.host.picture

clean: ## remove work/ except the download cache
	find $(WORK) -mindepth 1 -maxdepth 1 ! -name cache -exec rm -rf {} +
