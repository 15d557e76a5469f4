package tcattach

import (
	"errors"
	"fmt"
	"strings"

	"github.com/cilium/ebpf"
	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"

	"github.com/ipmasq/ipmasq/tables"
)

// clsactPriority is the priority of ipmasq's filters; filters of other
// programs at other priorities are never touched.
const clsactPriority = 0x4d51 // "MQ"

// clsactFilterName prefixes the names of ipmasq's filters, so prune finds
// them and only them.
const clsactFilterName = "ipmasq_"

func clsactParent(h hook) uint32 {
	if h.attach == ebpf.AttachTCXEgress {
		return netlink.HANDLE_MIN_EGRESS
	}
	return netlink.HANDLE_MIN_INGRESS
}

// attachClsact installs (or atomically replaces) ipmasq's filter on the
// device's clsact qdisc, creating the qdisc when missing (created says so).
// Filters live in the kernel, not the agent, so they keep translating
// across restarts.
func attachClsact(d *tables.DatapathDevice, h hook, prog *ebpf.Program) (created bool, err error) {
	qdisc := &netlink.Clsact{QdiscAttrs: netlink.QdiscAttrs{
		LinkIndex: d.Index, Handle: netlink.MakeHandle(0xffff, 0), Parent: netlink.HANDLE_CLSACT,
	}}
	switch err := netlink.QdiscAdd(qdisc); {
	case err == nil:
		created = true
	case !errors.Is(err, unix.EEXIST):
		return false, fmt.Errorf("%s: add clsact qdisc: %w", d.Name, err)
	}
	info, err := prog.Info()
	if err != nil {
		return created, err
	}
	filter := &netlink.BpfFilter{
		FilterAttrs: netlink.FilterAttrs{
			LinkIndex: d.Index, Parent: clsactParent(h), Handle: netlink.MakeHandle(0, 1),
			Protocol: unix.ETH_P_ALL, Priority: clsactPriority,
		},
		Fd: prog.FD(), Name: clsactFilterName + info.Name, DirectAction: true,
	}
	if err := netlink.FilterReplace(filter); err != nil {
		return created, fmt.Errorf("%s %s: replace clsact filter: %w", d.Name, h.name, err)
	}
	return created, nil
}

// detachClsact removes ipmasq's filter of one hook; the qdisc stays (other
// filters may use it).
func detachClsact(ifindex int, h hook) error {
	link, err := netlink.LinkByIndex(ifindex)
	if err != nil {
		return nil // the device is gone, and its filters with it
	}
	return deleteOurFilters(link, h)
}

// pruneClsact removes ipmasq's filters from every device not in want.
func pruneClsact(want map[int]bool) error {
	links, err := netlink.LinkList()
	if err != nil {
		return err
	}
	var errs []error
	for _, l := range links {
		if want[l.Attrs().Index] {
			continue
		}
		for _, h := range hooks {
			errs = append(errs, deleteOurFilters(l, h))
		}
	}
	return errors.Join(errs...)
}

func deleteOurFilters(link netlink.Link, h hook) error {
	filters, err := netlink.FilterList(link, clsactParent(h))
	if err != nil {
		// No clsact qdisc: nothing of ours.
		return nil
	}
	var errs []error
	for _, f := range filters {
		bf, ok := f.(*netlink.BpfFilter)
		if !ok || bf.Priority != clsactPriority || !strings.HasPrefix(bf.Name, clsactFilterName) {
			continue
		}
		if err := netlink.FilterDel(bf); err != nil && !errors.Is(err, unix.ENOENT) {
			errs = append(errs, fmt.Errorf("%s %s: delete clsact filter: %w", link.Attrs().Name, h.name, err))
		}
	}
	return errors.Join(errs...)
}
