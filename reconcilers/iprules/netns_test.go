package iprules_test

import (
	"errors"
	"fmt"
	"github.com/ipmasq/ipmasq/testkit/privtest"
	"os"
	"runtime"
	"sync/atomic"
	"testing"

	"github.com/vishvananda/netlink"
	"github.com/vishvananda/netns"
)

// testNetns is a network namespace of its own and a netlink handle into it.
// The test's threads never stay in it: the host's rules are never touched.
type testNetns struct {
	Name   string // "" unless named (visible to `ip -n`)
	Handle *netlink.Handle
	ns     netns.NsHandle
}

var netnsSeq atomic.Uint64

// openNetns creates a fresh network namespace, bind-mounted under
// /var/run/netns when named so that `ip -n <name>` reaches it.
func openNetns(named bool) (_ *testNetns, err error) {
	n := &testNetns{}
	if named {
		n.Name = fmt.Sprintf("ipmasq-iprules-%d-%d", os.Getpid(), netnsSeq.Add(1))
	}

	// Creating a namespace switches the calling thread into it: switch back
	// before anything else runs on this thread.
	runtime.LockOSThread()
	orig, err := netns.Get()
	if err != nil {
		runtime.UnlockOSThread()
		return nil, fmt.Errorf("get current netns: %w", err)
	}
	defer orig.Close()
	if named {
		n.ns, err = netns.NewNamed(n.Name)
	} else {
		n.ns, err = netns.New()
	}
	if serr := netns.Set(orig); serr != nil {
		// The thread is stuck in the new namespace; leaving it locked makes
		// the runtime discard it when the goroutine ends.
		return nil, fmt.Errorf("switch back to the original netns: %w", serr)
	}
	runtime.UnlockOSThread()
	if err != nil {
		return nil, fmt.Errorf("create netns: %w", err)
	}

	n.Handle, err = netlink.NewHandleAt(n.ns)
	if err != nil {
		return nil, errors.Join(fmt.Errorf("netlink handle in new netns: %w", err), n.Close())
	}
	return n, nil
}

// Close releases the namespace; the kernel frees it with its last reference.
func (n *testNetns) Close() error {
	if n.Handle != nil {
		n.Handle.Close()
	}
	err := n.ns.Close()
	if n.Name != "" {
		err = errors.Join(err, netns.DeleteNamed(n.Name))
	}
	return err
}

// newNetns returns a handle into a fresh network namespace that lives until
// the end of tb.
func newNetns(tb testing.TB, named bool) *testNetns {
	tb.Helper()
	privtest.Require(tb)
	n, err := openNetns(named)
	if err != nil {
		tb.Fatal(err)
	}
	tb.Cleanup(func() {
		if err := n.Close(); err != nil {
			tb.Errorf("close netns: %v", err)
		}
	})
	return n
}
