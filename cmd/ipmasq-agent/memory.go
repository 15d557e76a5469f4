package main

import (
	"os"
	"runtime/debug"
)

// defaultMemoryLimit is the Go runtime's soft memory limit when GOMEMLIMIT
// is not set. The agent's live heap is ~17 MiB at 16 384 CIDRs per family
// or 10 000 endpoints, but a config load or the first rule sync briefly
// needs twice that, and with only the default GC pacing the heap then
// stayed at 70–100 MiB of RSS long after (issue #14: the budget is 60 MiB).
// Near the limit the runtime collects sooner and returns freed pages to
// the OS; it is soft: with more live data the agent keeps working, at the
// cost of more frequent collections (capped by the runtime at about half
// of a CPU).
const defaultMemoryLimit = 40 << 20

// setMemoryLimit applies defaultMemoryLimit unless the operator chose one
// with GOMEMLIMIT (which the runtime has applied already; "off" disables
// it).
func setMemoryLimit() {
	if _, set := os.LookupEnv("GOMEMLIMIT"); !set {
		debug.SetMemoryLimit(defaultMemoryLimit)
	}
}
