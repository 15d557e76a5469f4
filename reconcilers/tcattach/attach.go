package tcattach

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"iter"
	"log/slog"
	"os"
	"path/filepath"
	"strconv"
	"strings"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/link"
	"github.com/cilium/statedb"
	"github.com/cilium/statedb/reconciler"

	"github.com/ipmasq/ipmasq/bpf"
	"github.com/ipmasq/ipmasq/reconcilers/datapath"
	"github.com/ipmasq/ipmasq/tables"
)

// hook is one tc attach point of a device.
type hook struct {
	name   string
	attach ebpf.AttachType
	// prog is the program for the device: the L3 variant when its packets
	// start at the network header (loaded at the first such device).
	prog func(dp *bpf.Datapath, l3 bool) (*ebpf.Program, error)
}

var hooks = []hook{
	{"egress", ebpf.AttachTCXEgress, func(dp *bpf.Datapath, l3 bool) (*ebpf.Program, error) {
		if l3 {
			egress, _, err := dp.ProgramsL3()
			return egress, err
		}
		return dp.Egress, nil
	}},
	{"ingress", ebpf.AttachTCXIngress, func(dp *bpf.Datapath, l3 bool) (*ebpf.Program, error) {
		if l3 {
			_, ingress, err := dp.ProgramsL3()
			return ingress, err
		}
		return dp.Ingress, nil
	}},
}

// attachOps reconciles datapath-devices into pinned tcx links and
// egress_devs entries.
type attachOps struct {
	linkDir string
	dp      *datapath.Handle
	// mode is datapath.AttachAuto, AttachTCX or AttachClsact; auto
	// becomes one of the others at the first attach.
	mode string
	// waitMaps waits (bounded) until the maps the programs read besides
	// the device's own entry are written; nil: no wait.
	waitMaps func(context.Context)
	log      *slog.Logger
}

var _ reconciler.Operations[*tables.DatapathDevice] = (*attachOps)(nil)

func (o *attachOps) pinPath(ifindex int, h hook) string {
	return filepath.Join(o.linkDir, fmt.Sprintf("%d-%s", ifindex, h.name))
}

// Update attaches both programs to the device, or swaps the program inside
// links left by a previous agent (atomic: no packet goes untranslated), and
// sets the device's SNAT addresses.
func (o *attachOps) Update(ctx context.Context, _ statedb.ReadTxn, _ statedb.Revision, d *tables.DatapathDevice) error {
	dp := o.dp.Get()
	if dp == nil {
		return datapath.ErrNotLoaded
	}
	if o.waitMaps != nil {
		o.waitMaps(ctx)
	}
	// The SNAT address first: a program must never see the device without it.
	if err := dp.SetEgressDevice(d.Index, d.SNATv4, d.SNATv6); err != nil {
		return err
	}
	for _, h := range hooks {
		prog, err := h.prog(dp, d.L3)
		if err != nil {
			return err
		}
		if err := o.attachHook(d, h, prog); err != nil {
			return err
		}
	}
	return nil
}

// attachHook attaches with tcx or clsact per mode; in auto mode a kernel
// without tcx switches the agent to clsact for good.
func (o *attachOps) attachHook(d *tables.DatapathDevice, h hook, prog *ebpf.Program) error {
	if o.mode == datapath.AttachClsact {
		return o.attachClsact(d, h, prog)
	}
	err := o.attach(d, h, prog)
	if o.mode == datapath.AttachAuto && errors.Is(err, ebpf.ErrNotSupported) {
		o.mode = datapath.AttachClsact
		return o.attachClsact(d, h, prog)
	}
	if err == nil && o.mode == datapath.AttachAuto {
		o.mode = datapath.AttachTCX
	}
	if err == nil {
		// A filter left by an agent that ran in clsact mode would run the
		// programs twice; harmless, but not what the operator asked for.
		err = detachClsact(d.Index, h)
	}
	return err
}

// QdiscCreatedMsg begins the line the agent logs when it creates a
// device's clsact qdisc (docs/deploy.md, "Kernels without tcx").
const QdiscCreatedMsg = "created the device's clsact qdisc"

// attachClsact attaches with a clsact filter and tells when it had to
// create the device's qdisc: Linux deactivates an UP device to graft one
// (qdisc_graft calls dev_deactivate), and drops what the device transmits
// until it is active again, a few milliseconds once per boot. Only an
// operator can avoid that moment (a qdisc made before traffic:
// docs/deploy.md), so the log says when it happened.
func (o *attachOps) attachClsact(d *tables.DatapathDevice, h hook, prog *ebpf.Program) error {
	created, err := attachClsact(d, h, prog)
	if created && o.log != nil {
		o.log.Info(QdiscCreatedMsg+": Linux paused its transmit to graft the qdisc and dropped what it sent in that moment (milliseconds, once per boot; a qdisc created before traffic avoids it: docs/deploy.md, \"Kernels without tcx\")",
			"device", d.Name)
	}
	return err
}

func (o *attachOps) attach(d *tables.DatapathDevice, h hook, prog *ebpf.Program) error {
	path := o.pinPath(d.Index, h)
	if l, err := link.LoadPinnedLink(path, nil); err == nil {
		info, ierr := l.Info()
		if tcx := info.TCX(); ierr == nil && tcx != nil && int(tcx.Ifindex) == d.Index {
			err := l.Update(prog)
			l.Close()
			if err == nil {
				return nil
			}
			return fmt.Errorf("%s %s: replace program in pinned link %s: %w", d.Name, h.name, path, err)
		}
		// The device the link was made for is gone (its index reused).
		l.Unpin()
		l.Close()
	} else if !errors.Is(err, fs.ErrNotExist) {
		os.Remove(path)
	}
	// The index is resolved in the caller's namespace (see Update). At the
	// head of the device's tcx chain: a program before ours that returns
	// "pass" (another CNI, a monitoring program) would otherwise keep a
	// reply from being translated back, or a pod's packet from being
	// masqueraded. Ours returns "next", so the others still see every
	// packet, translated. An existing pinned link keeps its place.
	l, err := link.AttachTCX(link.TCXOptions{Interface: d.Index, Program: prog, Attach: h.attach, Anchor: link.Head()})
	if err != nil {
		return fmt.Errorf("%s %s: attach tcx program: %w", d.Name, h.name, err)
	}
	defer l.Close()
	if err := os.MkdirAll(o.linkDir, 0o700); err != nil {
		return err
	}
	if err := l.Pin(path); err != nil {
		return fmt.Errorf("%s %s: pin link %s: %w", d.Name, h.name, path, err)
	}
	return nil
}

// Delete detaches the programs from the device and forgets its SNAT
// addresses.
func (o *attachOps) Delete(_ context.Context, _ statedb.ReadTxn, _ statedb.Revision, d *tables.DatapathDevice) error {
	var errs []error
	for _, h := range hooks {
		errs = append(errs, detach(o.pinPath(d.Index, h)))
		if o.mode != datapath.AttachTCX {
			errs = append(errs, detachClsact(d.Index, h))
		}
	}
	if dp := o.dp.Get(); dp != nil {
		if err := dp.Maps.EgressDevs.Delete(uint32(d.Index)); err != nil && !errors.Is(err, ebpf.ErrKeyNotExist) {
			errs = append(errs, fmt.Errorf("%s: delete egress_devs entry: %w", d.Name, err))
		}
		// After the detach: no program counts for it any more.
		errs = append(errs, bpf.ForgetDevCounters(dp.Maps.DevCounters, func(ifindex uint32) bool { return ifindex != uint32(d.Index) }))
	}
	return errors.Join(errs...)
}

// Prune detaches links and forgets SNAT addresses of devices that are no
// longer in the table (deselected while the agent was down, or gone).
func (o *attachOps) Prune(_ context.Context, _ statedb.ReadTxn, objs iter.Seq2[*tables.DatapathDevice, statedb.Revision]) error {
	want := map[int]bool{}
	for d := range objs {
		want[d.Index] = true
	}
	var errs []error
	entries, err := os.ReadDir(o.linkDir)
	if err != nil && !errors.Is(err, fs.ErrNotExist) {
		return err
	}
	for _, e := range entries {
		idx, _, ok := strings.Cut(e.Name(), "-")
		n, err := strconv.Atoi(idx)
		if !ok || err != nil || !want[n] {
			errs = append(errs, detach(filepath.Join(o.linkDir, e.Name())))
		}
	}
	if o.mode != datapath.AttachTCX {
		errs = append(errs, pruneClsact(want))
	}
	if dp := o.dp.Get(); dp != nil {
		var stale []uint32
		var k uint32
		var v bpf.EgressDev
		it := dp.Maps.EgressDevs.Iterate()
		for it.Next(&k, &v) {
			if !want[int(k)] {
				stale = append(stale, k)
			}
		}
		errs = append(errs, it.Err())
		for _, k := range stale {
			if err := dp.Maps.EgressDevs.Delete(k); err != nil && !errors.Is(err, ebpf.ErrKeyNotExist) {
				errs = append(errs, err)
			}
		}
		errs = append(errs, bpf.ForgetDevCounters(dp.Maps.DevCounters, func(ifindex uint32) bool { return want[int(ifindex)] }))
	}
	return errors.Join(errs...)
}

// detach removes a pinned link; closing its last reference detaches it.
func detach(path string) error {
	l, err := link.LoadPinnedLink(path, nil)
	if errors.Is(err, fs.ErrNotExist) {
		return nil
	}
	if err != nil {
		// Not a link (or unreadable): remove the pin so it cannot confuse us.
		if rmErr := os.Remove(path); rmErr != nil && !errors.Is(rmErr, fs.ErrNotExist) {
			return fmt.Errorf("remove %s: %w", path, rmErr)
		}
		return nil
	}
	defer l.Close()
	if err := l.Unpin(); err != nil {
		return fmt.Errorf("unpin %s: %w", path, err)
	}
	return nil
}
