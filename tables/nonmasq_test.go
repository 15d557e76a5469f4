package tables

import (
	"net/netip"
	"testing"

	"github.com/cilium/statedb/index"
)

// TestPrefixKeyIsNetIPPrefix: the primary key is byte for byte statedb's
// NetIPPrefix key, so string queries (FromString) and rows agree.
func TestPrefixKeyIsNetIPPrefix(t *testing.T) {
	for _, s := range []string{"0.0.0.0/0", "10.0.0.0/8", "10.1.2.3/8", "192.168.1.0/24", "255.255.255.255/32",
		"::/0", "::ffff:10.0.0.0/104", "64:ff9b::/96", "fe80::/10", "2001:db8::1/128"} {
		p := netip.MustParsePrefix(s)
		if got, want := prefixKey(p), index.NetIPPrefix(p); !got.Equal(want) {
			t.Errorf("%s: key %x, want %x", s, got, want)
		}
	}
	if testing.AllocsPerRun(100, func() { prefixKey(netip.MustParsePrefix("10.0.0.0/8")) }) > 1 {
		t.Error("prefixKey allocates more than once")
	}
}
