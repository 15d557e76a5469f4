# ipmasq — make targets. Tests and the demo need root (BPF maps, bpffs
# mounts, network namespaces); nothing else beyond Go.

GO        ?= go
BIN       := bin
PKGS      := ./...
BENCHTIME ?= 20x

# The version stamped into the binaries (ipmasq-agent --version, the start
# log line, the ipmasq_build_info metric) and the image's version label.
VERSION   ?= $(shell git describe --tags --always --dirty 2>/dev/null || echo unknown)
REVISION  ?= $(shell git rev-parse HEAD 2>/dev/null)
LDFLAGS   := -X github.com/ipmasq/ipmasq/internal/buildinfo.version=$(VERSION) \
             -X github.com/ipmasq/ipmasq/internal/buildinfo.revision=$(REVISION)
# The image: its reference (registry/repository:tag) and the tarball.
# Unset, the reference is the repository deploy/image/kustomization.yaml
# names, tagged with VERSION (a dirty tree's with the image's digest too),
# and make image sets that file's newTag to it: `kubectl apply -k deploy/`
# runs what `make image` built, and a new build rolls the DaemonSet.
IMAGE      ?=
IMAGE_TAR  ?= $(BIN)/ipmasq-agent-image.tar
# The kustomize component whose newTag a plain `make image` sets.
DEPLOY_IMAGE ?= deploy/image/kustomization.yaml
# The platforms of the image (the eBPF object is little-endian: both load it).
IMAGE_ARCHS := amd64 arm64
# Image files get the commit's time, so a commit builds the same image.
SOURCE_DATE_EPOCH ?= $(shell git log -1 --format=%ct 2>/dev/null || echo 0)

.PHONY: all build image push deps test demo generate bench bench-datapath vet fmt clean

all: build

## build: compile ipmasq-agent and ipmasq-demo into bin/
build:
	$(GO) build -ldflags "$(LDFLAGS)" -o $(BIN)/ ./cmd/...

## image: the agent's OCI image index for linux/amd64 and linux/arm64 (a
## static binary and nothing else), built without a container daemon, as
## an OCI image layout tarball $(IMAGE_TAR) tagged <deploy's repository>:$(VERSION)
## (a dirty tree's tag ends in the image's digest), with newTag in
## deploy/image/kustomization.yaml set to it: ctr -n k8s.io images import $(IMAGE_TAR)
## Another reference (deploy/ left as it is): IMAGE=registry/repo:tag
image:
	for arch in $(IMAGE_ARCHS); do \
		CGO_ENABLED=0 GOOS=linux GOARCH=$$arch $(GO) build -trimpath -ldflags "$(LDFLAGS)" \
			-o $(BIN)/image/linux-$$arch/ipmasq-agent ./cmd/ipmasq-agent || exit 1; \
	done
	SOURCE_DATE_EPOCH=$(SOURCE_DATE_EPOCH) $(GO) run ./tools/mkimage \
		$(foreach arch,$(IMAGE_ARCHS),--binary $(BIN)/image/linux-$(arch)/ipmasq-agent) \
		$(if $(IMAGE),--image $(IMAGE),--deploy-image $(DEPLOY_IMAGE)) --version $(VERSION) --output $(IMAGE_TAR)

## push: build the image and push it, both platforms, to IMAGE=registry/repo:tag
## without a container daemon (credentials: ~/.docker/config.json)
ifneq ($(filter push,$(MAKECMDGOALS)),)
ifeq ($(IMAGE),)
$(error make push needs IMAGE=registry/repository:tag)
endif
endif
push: image
	$(GO) run ./tools/mkimage push --archive $(IMAGE_TAR) --image $(IMAGE)

FUZZTIME  ?= 60000x

## deps: install the Debian packages the tests need (as root, once; tools/deps.sh)
deps:
	@sh tools/deps.sh

## test: the Debian packages the tests need (deps), vet, every test (unit,
## script, privileged, and the kernel matrix: Debian's 5.10, 6.1 and 6.12
## kernels under qemu, about 10 minutes each, hence the timeout) once,
## uncached, then the
## config parser's fuzzer for a fixed number of inputs (a fixed-time run can end in
## "context deadline exceeded" when it stops during minimization)
test: deps vet
	$(GO) test -count=1 -timeout 60m $(PKGS)
	$(GO) test -run '^$$' -fuzz '^FuzzParse$$' -fuzztime $(FUZZTIME) -fuzzminimizetime 2s ./cells/config/

## demo: run the agent on a built-in config with a private bpffs and show its maps
demo: build
	$(BIN)/ipmasq-demo --agent $(BIN)/ipmasq-agent

## generate: regenerate generated code (bpf2go output is committed)
generate:
	$(GO) generate $(PKGS)

## bench: benchmarks with their same-run baselines (see docs/benchmarks.md);
## about 33 minutes, most of it the real-kernel scenarios of testkit/e2e
## (BenchmarkPerDestinationRate sustains 8 conditions for 150 s each: 1 and 50
## pods, both close orders, MASQUERADE and ipmasq; BenchmarkDNSBurst 4 for
## 100 s each; BenchmarkNATScale about 15 minutes, 20 listings of up to
## 1 000 000 pairs and of conntrack's 250 000 entries)
bench:
	$(GO) test -run '^$$' -bench . -benchtime $(BENCHTIME) -count 1 -timeout 60m $(PKGS)

## bench-datapath: the datapath's per-packet benchmarks (bpf/bench_test.go),
## full and compat builds, each interleaved in the same run with the object
## of BASELINE (a git revision, default main; its compat object for the
## compat build where it has one): ns/pkt, baseline-ns/pkt and x-baseline,
## DATAPATH_COUNT runs each (see docs/datapath-benchmarks.md); about 10 min
BASELINE       ?= main
DATAPATH_COUNT ?= 6
bench-datapath:
	@mkdir -p $(BIN)
	git show $(BASELINE):bpf/masq_bpfel.o > $(BIN)/baseline-masq_bpfel.o
	git show $(BASELINE):bpf/masqcompat_bpfel.o > $(BIN)/baseline-masqcompat_bpfel.o 2>/dev/null || \
		cp $(BIN)/baseline-masq_bpfel.o $(BIN)/baseline-masqcompat_bpfel.o
	$(GO) test -c -o $(BIN)/bpf.test ./bpf/
	cd bpf && $(abspath $(BIN))/bpf.test -test.run '^$$' -test.bench 'BenchmarkEgress|BenchmarkIngressReply' \
		-test.benchtime 200000x -test.count $(DATAPATH_COUNT) -bpf.baseline=$(abspath $(BIN))/baseline-masq_bpfel.o
	cd bpf && IPMASQ_TEST_DATAPATH_VARIANT=compat $(abspath $(BIN))/bpf.test -test.run '^$$' -test.bench 'BenchmarkEgress|BenchmarkIngressReply' \
		-test.benchtime 200000x -test.count $(DATAPATH_COUNT) -bpf.baseline=$(abspath $(BIN))/baseline-masqcompat_bpfel.o

## vet: go vet, gofmt, and go.mod/go.sum tidy (go mod tidy must change nothing)
vet:
	$(GO) vet $(PKGS)
	@$(GO) mod tidy -diff >/dev/null || { $(GO) mod tidy -diff; echo "go.mod/go.sum are not tidy: run go mod tidy"; exit 1; }
	@unformatted=$$(gofmt -l $$(git ls-files '*.go' 2>/dev/null || find . -name '*.go')); \
	if [ -n "$$unformatted" ]; then echo "gofmt needed: $$unformatted"; exit 1; fi

fmt:
	gofmt -w $$(git ls-files '*.go')

clean:
	rm -rf $(BIN)
