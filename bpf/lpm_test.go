package bpf

import (
	"bytes"
	"encoding/binary"
	"net/netip"
	"testing"

	"github.com/cilium/ebpf"
	"github.com/ipmasq/ipmasq/testkit/privtest"
)

func TestLPMKeyRoundTrip(t *testing.T) {
	for _, s := range []string{"0.0.0.0/0", "10.0.0.0/8", "192.168.6.0/24", "203.0.113.7/32"} {
		p := netip.MustParsePrefix(s)
		if got := LPMKeyV4From(p).Prefix(); got != p {
			t.Errorf("LPMKeyV4From(%s).Prefix() = %s", s, got)
		}
	}
	for _, s := range []string{"::/0", "fe80::/10", "2001:db8::/32", "2001:db8::1/128"} {
		p := netip.MustParsePrefix(s)
		if got := LPMKeyV6From(p).Prefix(); got != p {
			t.Errorf("LPMKeyV6From(%s).Prefix() = %s", s, got)
		}
	}
}

func TestLPMKeyMasksHostBits(t *testing.T) {
	if got, want := LPMKeyV4From(netip.MustParsePrefix("10.1.2.3/8")), key4("10.0.0.0/8"); got != want {
		t.Errorf("LPMKeyV4From(10.1.2.3/8) = %v, want %v", got, want)
	}
	if got := LPMKeyV4From(netip.MustParsePrefix("::ffff:10.1.0.0/112")).Prefix().String(); got != "10.1.0.0/16" {
		t.Errorf("IPv4-mapped prefix gave %s, want 10.1.0.0/16", got)
	}
	if got := LPMKeyV6From(netip.MustParsePrefix("fe80::1/10")).Prefix().String(); got != "fe80::/10" {
		t.Errorf("LPMKeyV6From(fe80::1/10) = %s", got)
	}
}

func TestLPMKeyPanicsOnWrongFamily(t *testing.T) {
	for name, f := range map[string]func(){
		"v4 from v6": func() { LPMKeyV4From(netip.MustParsePrefix("2001:db8::/32")) },
		"v6 from v4": func() { LPMKeyV6From(netip.MustParsePrefix("10.0.0.0/8")) },
		"invalid":    func() { LPMKeyV4From(netip.Prefix{}) },
	} {
		func() {
			defer func() {
				if recover() == nil {
					t.Errorf("%s: no panic", name)
				}
			}()
			f()
		}()
	}
}

// The key must be laid out like struct { __u32 prefixlen; __u8 addr[N]; }.
func TestLPMKeyLayout(t *testing.T) {
	var buf bytes.Buffer
	if err := binary.Write(&buf, binary.NativeEndian, key4("192.168.1.0/24")); err != nil {
		t.Fatal(err)
	}
	want := binary.NativeEndian.AppendUint32(nil, 24)
	want = append(want, 192, 168, 1, 0)
	if !bytes.Equal(buf.Bytes(), want) {
		t.Fatalf("v4 key bytes = %x, want %x", buf.Bytes(), want)
	}
	if n := binary.Size(LPMKeyV6{}); n != 20 {
		t.Fatalf("v6 key is %d bytes, want 20", n)
	}
}

// The kernel agrees with the layout: a lookup of a host address in the
// nonmasq trie (bpf2go's spec) finds its longest matching prefix.
func TestLPMTrieLongestMatch(t *testing.T) {
	privtest.Require(t)
	spec, err := loadMasq()
	if err != nil {
		t.Fatal(err)
	}
	ms := spec.Maps[MapNonMasqV4].Copy()
	ms.MaxEntries = 8
	m, err := ebpf.NewMap(ms)
	if err != nil {
		t.Fatal(err)
	}
	defer m.Close()
	for k, v := range map[LPMKeyV4]uint8{key4("10.0.0.0/8"): 0, key4("10.1.0.0/16"): 1} {
		if err := m.Put(k, v); err != nil {
			t.Fatalf("put %s: %v", k, err)
		}
	}
	for addr, want := range map[string]uint8{"10.1.2.3": 1, "10.2.0.1": 0} {
		var got uint8
		if err := m.Lookup(key4(addr+"/32"), &got); err != nil {
			t.Fatalf("lookup %s: %v", addr, err)
		}
		if got != want {
			t.Errorf("lookup %s = %d, want %d", addr, got, want)
		}
	}
}

func key4(s string) LPMKeyV4 { return LPMKeyV4From(netip.MustParsePrefix(s)) }
