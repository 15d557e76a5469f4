package tcattach

import (
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"strings"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/link"
	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"
)

// Detach takes the datapath off the node for `ipmasq-agent uninstall`,
// with no agent running: it unpins every link under <pinDir>/links
// (closing the last reference detaches the tcx program) and deletes
// ipmasq's clsact filters (clsactPriority, clsactFilterName) from every
// device of the caller's network namespace, whatever mode the agent ran
// in. The clsact qdiscs stay: another program may use them. The maps are
// not touched; report is called once per object removed, with a line an
// operator reads.
func Detach(pinDir string, report func(string)) error {
	var errs []error
	linkDir := filepath.Join(pinDir, "links")
	entries, err := os.ReadDir(linkDir)
	if err != nil && !errors.Is(err, fs.ErrNotExist) {
		return err
	}
	for _, e := range entries {
		path := filepath.Join(linkDir, e.Name())
		what := describeLink(path)
		if err := detach(path); err != nil {
			errs = append(errs, err)
			continue
		}
		report(what)
	}
	links, err := netlink.LinkList()
	if err != nil {
		return errors.Join(append(errs, fmt.Errorf("list devices: %w", err))...)
	}
	for _, l := range links {
		for _, h := range hooks {
			filters, err := netlink.FilterList(l, clsactParent(h))
			if err != nil {
				continue // no clsact qdisc: nothing of ours
			}
			for _, f := range filters {
				bf, ok := f.(*netlink.BpfFilter)
				if !ok || bf.Priority != clsactPriority || !strings.HasPrefix(bf.Name, clsactFilterName) {
					continue
				}
				if err := netlink.FilterDel(bf); err != nil && !errors.Is(err, unix.ENOENT) {
					errs = append(errs, fmt.Errorf("%s %s: delete clsact filter %s: %w", l.Attrs().Name, h.name, bf.Name, err))
					continue
				}
				report(fmt.Sprintf("detached clsact %s filter %s (program id %d) from %s", h.name, bf.Name, bf.Id, l.Attrs().Name))
			}
		}
	}
	return errors.Join(errs...)
}

// describeLink says what unpinning path detaches, e.g. "detached tcx
// egress program masq_egress from eth0 (pinned link .../links/3-egress)".
func describeLink(path string) string {
	l, err := link.LoadPinnedLink(path, nil)
	if err != nil {
		return "removed pin " + path
	}
	defer l.Close()
	info, err := l.Info()
	if err != nil {
		return "detached pinned link " + path
	}
	where := "?"
	dir := "tcx"
	if tcx := info.TCX(); tcx != nil {
		where = fmt.Sprintf("ifindex %d", tcx.Ifindex)
		if dev, err := netlink.LinkByIndex(int(tcx.Ifindex)); err == nil {
			where = dev.Attrs().Name
		}
		switch ebpf.AttachType(tcx.AttachType) {
		case ebpf.AttachTCXEgress:
			dir = "tcx egress"
		case ebpf.AttachTCXIngress:
			dir = "tcx ingress"
		}
	}
	prog := fmt.Sprintf("program id %d", info.Program)
	if p, err := ebpf.NewProgramFromID(info.Program); err == nil {
		if pi, err := p.Info(); err == nil && pi.Name != "" {
			prog = "program " + pi.Name
		}
		p.Close()
	}
	return fmt.Sprintf("detached %s %s from %s (pinned link %s)", dir, prog, where, path)
}
