package devices

import (
	"fmt"
	"runtime"

	"github.com/vishvananda/netns"
)

// Do runs fn with the calling thread inside the namespace, for operations
// that resolve interface indexes in the caller's namespace (tcx attach,
// /proc/sys/net). A nil Netns runs fn in the agent's own namespace.
func (n *Netns) Do(fn func() error) error {
	if n == nil {
		return fn()
	}
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	orig, err := netns.Get()
	if err != nil {
		return fmt.Errorf("get network namespace: %w", err)
	}
	defer orig.Close()
	if err := netns.Set(n.Handle); err != nil {
		return fmt.Errorf("enter network namespace: %w", err)
	}
	defer func() {
		if err := netns.Set(orig); err != nil {
			// The thread is unusable; never hand it back to the runtime.
			panic(fmt.Sprintf("restore network namespace: %v", err))
		}
	}()
	return fn()
}
