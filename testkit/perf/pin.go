package perf

import (
	"fmt"
	"os/exec"

	"golang.org/x/sys/unix"

	"github.com/ipmasq/ipmasq/cmd/ipmasq-demo/topology"
)

// StartPinned starts cmd inside ns with its CPU affinity set to cpu alone. A
// child inherits both the network namespace and the affinity of the thread
// that forks it, so the calling thread is moved for the fork only and
// restored before it goes back to the Go scheduler.
func StartPinned(ns *topology.Netns, cpu int, cmd *exec.Cmd) error {
	return ns.Do(func() error {
		var old, one unix.CPUSet
		if err := unix.SchedGetaffinity(0, &old); err != nil {
			return fmt.Errorf("get CPU affinity: %w", err)
		}
		one.Set(cpu)
		if err := unix.SchedSetaffinity(0, &one); err != nil {
			return fmt.Errorf("pin to CPU %d: %w", cpu, err)
		}
		defer func() {
			if err := unix.SchedSetaffinity(0, &old); err != nil {
				panic(fmt.Sprintf("restore CPU affinity: %v", err))
			}
		}()
		return cmd.Start()
	})
}
