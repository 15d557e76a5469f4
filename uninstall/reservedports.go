package uninstall

import (
	"errors"
	"fmt"
	"os"
	"strconv"
	"strings"

	"github.com/ipmasq/ipmasq/reconcilers/datapath"
)

// ReservedPortsPath is the sysctl an older ipmasq wrote: when its
// --nat-port-range overlapped ip_local_port_range, it appended the range to
// the network namespace's ip_local_reserved_ports. This version writes no
// sysctl (the datapath checks the node's sockets instead); the uninstall
// takes such a reservation back.
const ReservedPortsPath = "/proc/sys/net/ipv4/ip_local_reserved_ports"

// removeOldReservation takes back the reservation an older agent made, and
// nothing else. The older agent left no mark of its own, so a reservation
// is taken as its only when
//
//   - ipmasq was installed here: installed says its pin directory or state
//     directory was found (before this run removed them), and
//   - the list holds one of the agent's NAT ranges (natRanges: the
//     agent's --nat-port-range, by default its default 61000-65535) as an
//     item of its own, exactly: the kernel merges touching and overlapping
//     ranges when it prints the list, so a range the operator reserved
//     around or next to it shows as another item, and stays.
//
// A range found inside a larger item is left and said (a note: it may be
// the operator's). Where the sysctl cannot be written (/proc/sys
// read-only, as in the uninstall Job's container), the note says what to
// write on the node; that is not an error: the node works either way, its
// own connections just never use those ports.
func removeOldReservation(path string, natRanges datapath.PortRanges, installed bool, report, note func(string)) error {
	data, err := os.ReadFile(path)
	if errors.Is(err, os.ErrNotExist) {
		return nil
	}
	if err != nil {
		return fmt.Errorf("read %s: %w", path, err)
	}
	cur := strings.TrimSpace(string(data))
	if cur == "" || !installed {
		return nil
	}
	var keep, removed []string
	for _, item := range strings.Split(cur, ",") {
		item = strings.TrimSpace(item)
		if isNATRange(item, natRanges) {
			removed = append(removed, item)
			continue
		}
		if covers(item, natRanges) {
			note(fmt.Sprintf("uninstall: %s holds %s, which covers a NAT port range of ipmasq (%s) and more: left as it is (remove ipmasq's part by hand if an older ipmasq reserved it)", path, item, natRanges))
		}
		keep = append(keep, item)
	}
	if len(removed) == 0 {
		return nil
	}
	next := strings.Join(keep, ",")
	// An empty write leaves the list as it is; a newline clears it.
	if err := os.WriteFile(path, []byte(next+"\n"), 0o644); err != nil {
		note(fmt.Sprintf("uninstall: %s holds %s, which an older ipmasq reserved; cannot write it here (%v): on the node, run sysctl -w net.ipv4.ip_local_reserved_ports=%q",
			path, strings.Join(removed, ","), err, next))
		return nil
	}
	for _, r := range removed {
		report(fmt.Sprintf("removed %s from %s (reserved by an older ipmasq)", r, path))
	}
	return nil
}

// parseItem reads an item of the kernel's list: "p" or "a-b".
func parseItem(item string) (datapath.PortRange, bool) {
	lo, hi, ok := strings.Cut(item, "-")
	if !ok {
		hi = lo
	}
	a, err1 := strconv.ParseUint(lo, 10, 16)
	b, err2 := strconv.ParseUint(hi, 10, 16)
	if err1 != nil || err2 != nil || b < a {
		return datapath.PortRange{}, false
	}
	return datapath.PortRange{Min: uint16(a), Max: uint16(b)}, true
}

func isNATRange(item string, natRanges datapath.PortRanges) bool {
	r, ok := parseItem(item)
	if !ok {
		return false
	}
	for _, n := range natRanges {
		if n == r {
			return true
		}
	}
	return false
}

func covers(item string, natRanges datapath.PortRanges) bool {
	r, ok := parseItem(item)
	if !ok {
		return false
	}
	for _, n := range natRanges {
		if r.Min <= n.Min && n.Max <= r.Max {
			return true
		}
	}
	return false
}
