// Command probe reports, as one JSON object on standard output, what the
// kernel it runs on offers the datapath: its release, whether a tcx link
// can be made (a trial attach of a minimal tc program to lo in a network
// namespace of its own), and whether it has the conntrack kfuncs the flow
// handover needs (with nf_conntrack loaded: the matrix's script loads
// it). The kernel matrix runs it in each guest.
package main

import (
	"encoding/json"
	"fmt"
	"os"
	"runtime"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/asm"
	"github.com/cilium/ebpf/link"
	"github.com/cilium/ebpf/rlimit"
	"github.com/vishvananda/netns"
	"golang.org/x/sys/unix"

	"github.com/ipmasq/ipmasq/bpf"
)

// Report is the probe's output.
type Report struct {
	Release string `json:"release"`
	// TCX says whether a tcx link attached; TCXError is why not.
	TCX      bool   `json:"tcx"`
	TCXError string `json:"tcx_error,omitempty"`
	// ConntrackKfuncs says whether the kernel has bpf_skb_ct_lookup
	// (bpf.ConntrackLookupAvailable): the handover of flows between
	// conntrack and the datapath needs it.
	ConntrackKfuncs bool `json:"conntrack_kfuncs"`
}

func main() {
	var r Report
	var u unix.Utsname
	if err := unix.Uname(&u); err == nil {
		r.Release = unix.ByteSliceToString(u.Release[:])
	}
	if err := tcx(); err != nil {
		r.TCXError = err.Error()
	} else {
		r.TCX = true
	}
	ok, err := bpf.ConntrackLookupAvailable()
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	r.ConntrackKfuncs = ok
	if err := json.NewEncoder(os.Stdout).Encode(r); err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
}

func tcx() error {
	if err := rlimit.RemoveMemlock(); err != nil {
		return err
	}
	prog, err := ebpf.NewProgram(&ebpf.ProgramSpec{
		Type:         ebpf.SchedCLS,
		License:      "GPL",
		Instructions: asm.Instructions{asm.Mov.Imm(asm.R0, 0), asm.Return()},
	})
	if err != nil {
		return fmt.Errorf("load a minimal tc program: %w", err)
	}
	defer prog.Close()
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	orig, err := netns.Get()
	if err != nil {
		return err
	}
	defer orig.Close()
	ns, err := netns.New()
	if err != nil {
		return err
	}
	defer ns.Close()
	defer netns.Set(orig)
	l, err := link.AttachTCX(link.TCXOptions{Interface: 1, Program: prog, Attach: ebpf.AttachTCXEgress})
	if err != nil {
		return err
	}
	return l.Close()
}
