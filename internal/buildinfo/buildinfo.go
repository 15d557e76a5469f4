// Package buildinfo is the version of the binary that holds it: set at
// link time by `make build` and `make image` from `git describe --tags
// --always --dirty`, so that `ipmasq-agent --version`, the agent's start
// log line, the ipmasq_build_info metric and the image tag name the same
// build. It is a leaf: it imports nothing of the module.
package buildinfo

import (
	"runtime"
	"runtime/debug"
)

// version is set by the linker:
//
//	go build -ldflags "-X github.com/ipmasq/ipmasq/internal/buildinfo.version=v1.2.3 \
//	    -X github.com/ipmasq/ipmasq/internal/buildinfo.revision=<commit>" ./cmd/ipmasq-agent
//
// Empty when the binary was built without it (go build, go test).
var version string

// revision is the commit, set by the linker like version (the go
// command's own VCS stamp is off where GOFLAGS has -buildvcs=false).
var revision string

// Version is the build's version: the one stamped at link time, else the
// main module's version as the go command recorded it (a pseudo-version
// from the VCS, "(devel)" when it had none), else "unknown".
func Version() string {
	if version != "" {
		return version
	}
	if bi, ok := debug.ReadBuildInfo(); ok && bi.Main.Version != "" {
		return bi.Main.Version
	}
	return "unknown"
}

// Revision is the commit of the build: the one stamped at link time, else
// the VCS revision the go command recorded (with "-dirty" when the tree
// had uncommitted changes); empty when there is neither (a build outside
// a repository, or with -buildvcs=false).
func Revision() string {
	if revision != "" {
		return revision
	}
	bi, ok := debug.ReadBuildInfo()
	if !ok {
		return ""
	}
	var rev string
	var modified bool
	for _, s := range bi.Settings {
		switch s.Key {
		case "vcs.revision":
			rev = s.Value
		case "vcs.modified":
			modified = s.Value == "true"
		}
	}
	if rev != "" && modified {
		rev += "-dirty"
	}
	return rev
}

// GoVersion is the Go release the binary was built with.
func GoVersion() string { return runtime.Version() }

// String is the one-line form printed by --version and logged at start:
// "v1.2.3 (go1.26.8, linux/amd64)".
func String() string {
	return Version() + " (" + GoVersion() + ", " + runtime.GOOS + "/" + runtime.GOARCH + ")"
}
