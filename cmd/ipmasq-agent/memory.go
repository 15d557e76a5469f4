package main

import (
	"context"
	"log/slog"
	"os"
	"runtime/debug"
	"runtime/metrics"
	"time"

	"github.com/ipmasq/ipmasq/internal/cgroupmem"
)

// memoryLimitShare is the part of the agent's cgroup memory limit that the
// Go runtime is asked to stay under when GOMEMLIMIT is not set: near it the
// runtime collects sooner and returns freed pages, instead of letting
// garbage of a load spike push the container over its limit (an OOM kill
// is a crash loop). The rest is room for what the Go runtime does not
// count (binary pages, thread stacks).
//
// A fixed small limit kept RSS low in the benchmarks but made the runtime
// collect without pause once the live data grew past it (the figures are
// in docs/benchmarks.md). The cgroup's limit is the operator's own budget.
const memoryLimitShare = 0.9

// gcPercent is the agent's GOGC when its environment sets none: the heap
// may grow to five times the live data before a collection, instead of
// twice. The agent's work comes in bursts: a 16 384-prefix config
// allocates about as much as the agent's whole live data, so with
// GOGC=100 almost every such load started a collection half-way, whose
// mark assists and background worker took the CPU from the path to the
// maps. What this costs is a higher peak during a burst (figures in the
// README and docs/benchmarks.md); it stays bounded by the
// soft memory limit (setMemoryLimit), near which the runtime collects
// sooner whatever GOGC says, and the memoryReleaser hands it back once the
// burst is over, so the RSS of a quiet agent is the same.
const gcPercent = 400

// setGCPercent sets GOGC to gcPercent unless the operator chose one with
// the GOGC environment variable (which the runtime has applied already).
func setGCPercent(log *slog.Logger, lookupEnv func(string) (string, bool)) {
	if _, set := lookupEnv("GOGC"); set {
		return
	}
	debug.SetGCPercent(gcPercent)
	log.Debug("Go GC percent set", "GOGC", gcPercent)
}

// setMemoryLimit gives the Go runtime a soft memory limit of
// memoryLimitShare of the agent's cgroup memory limit (v2, or v1's memory
// controller: internal/cgroupmem), unless the operator chose one with
// GOMEMLIMIT (which the runtime has applied already; "off" disables it) or
// the cgroup has no limit. The datapath lowers it further once it has sized
// the NAT maps, whose kernel memory the cgroup counts too.
func setMemoryLimit(log *slog.Logger) {
	if _, set := os.LookupEnv("GOMEMLIMIT"); set {
		return
	}
	limit, err := cgroupmem.Read(cgroupmem.ProcSelfCgroup, cgroupmem.Root)
	if err != nil {
		log.Debug("No Go memory limit: cgroup memory limit unknown", "error", err)
		return
	}
	if limit.Bytes <= 0 {
		return
	}
	soft := int64(float64(limit.Bytes) * memoryLimitShare)
	debug.SetMemoryLimit(soft)
	log.Debug("Go memory limit from the cgroup", "cgroupLimit", limit.String(), "goMemoryLimit", soft)
}

// How the agent notices that a burst of work has ended.
const (
	// releaseCheckInterval is how often the allocation counter is read.
	releaseCheckInterval = 500 * time.Millisecond
	// burstBytes allocated since the last release make one worth its
	// collection. Garbage of a smaller burst stays resident until the
	// runtime's next collection, which, with the live heap at 20 MiB,
	// waits for 20 MiB more: 300 allocations over the API after 10 000
	// endpoints leave ~10 MiB, that at 16 MiB were kept (anonymous RSS 36
	// instead of 28 MiB). An idle agent still makes none in 30 s (its
	// allocations stay under quietBytes and add up slowly).
	burstBytes = 4 << 20
	// quietBytes: at most this much allocated within one check interval
	// means the burst is over (an idle agent allocates far less: one
	// release in 30 s after a 16 384-CIDR load, the one after the load).
	quietBytes = 1 << 20
)

// memoryReleaser returns to the kernel, once the agent is quiet again, the
// heap that a burst of work left behind: loading 16 384 CIDRs per family
// or restoring 10 000 endpoints allocates hundreds of MiB, of which 19-22
// MiB stay live, but without a memory limit the runtime keeps the rest
// resident until its scavenger slowly gives it back (anonymous RSS 50-80
// MiB after such a load). One forced collection and release after the
// burst brings it close to the live data (26-43 MiB) at the cost of that
// collection, and, unlike a small GOMEMLIMIT, never runs while the agent
// is busy.
type memoryReleaser struct {
	allocated func() uint64 // cumulative heap allocations, bytes
	release   func()
	// last is the counter at the previous check, mark after the last
	// release.
	last, mark uint64
}

func newMemoryReleaser(log *slog.Logger) *memoryReleaser {
	sample := []metrics.Sample{{Name: "/gc/heap/allocs:bytes"}}
	return &memoryReleaser{
		allocated: func() uint64 {
			metrics.Read(sample)
			return sample[0].Value.Uint64()
		},
		release: func() {
			start := time.Now()
			debug.FreeOSMemory()
			log.Debug("Memory of a burst of work returned to the kernel", "took", time.Since(start))
		},
	}
}

// check releases memory if a burst of at least burstBytes has ended since
// the last release, and reports whether it did.
func (r *memoryReleaser) check() bool {
	now := r.allocated()
	quiet := now-r.last <= quietBytes
	r.last = now
	if !quiet || now-r.mark < burstBytes {
		return false
	}
	r.release()
	r.mark = r.allocated()
	r.last = r.mark
	return true
}

// run checks every interval until ctx ends.
func (r *memoryReleaser) run(ctx context.Context, interval time.Duration) {
	t := time.NewTicker(interval)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
			r.check()
		}
	}
}
