package iprules

import (
	"errors"
	"fmt"
	"net"
	"net/netip"
	"testing"

	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"

	"github.com/ipmasq/ipmasq/tables"
	"github.com/ipmasq/ipmasq/testkit/privtest"
)

// The kernel refuses one request in the middle of a pipelined batch: its
// ack carries the error, matched to that request by sequence number, and
// every other request of the batch (before and after it, in other
// datagrams too) is written.
func TestPipeMatchesEachAckToItsRequest(t *testing.T) {
	ns, h := privtest.NewNetns(t)
	target, err := NewNetlinkTargetAt(ns)
	if err != nil {
		t.Fatal(err)
	}
	defer target.Close()
	p := target.(*netlinkTarget).pipe

	const n, badAt = 700, 400 // the bad request is in the second datagram
	rules := make([]*netlink.Rule, n)
	for i := range rules {
		from := fmt.Sprintf("10.96.%d.%d/32", i/250, i%250+1)
		if i == badAt {
			from = "10.0.0.5/32"
		}
		rules[i], err = toRule(tables.IPRuleKey{Priority: 111, Table: 11,
			From: netip.MustParsePrefix(from), To: netip.MustParsePrefix("10.0.0.0/8")})
		if err != nil {
			t.Fatal(err)
		}
	}
	// An IPv4 rule with a 64-bit source prefix: the kernel answers EINVAL.
	rules[badAt].Src = &net.IPNet{IP: net.ParseIP("fd00::5"), Mask: net.CIDRMask(64, 128)}

	errs := p.exchange(unix.RTM_NEWRULE, rules)
	for i, err := range errs {
		if i == badAt {
			if !errors.Is(err, unix.EINVAL) {
				t.Fatalf("bad request's answer = %v, want EINVAL", err)
			}
		} else if err != nil {
			t.Fatalf("answer [%d] = %v, want nil", i, err)
		}
	}
	listed, err := target.List()
	if err != nil {
		t.Fatal(err)
	}
	if len(listed) != n-1 {
		t.Fatalf("%d owned rules, want %d", len(listed), n-1)
	}
	got, err := h.RuleList(unix.AF_INET)
	if err != nil {
		t.Fatal(err)
	}
	for _, r := range got {
		if r.Src != nil && r.Src.IP.Equal(net.ParseIP("10.0.0.5")) {
			t.Fatalf("the refused rule is in the kernel: %v", r)
		}
	}
}
