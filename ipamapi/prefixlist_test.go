package ipamapi

import (
	"encoding/json"
	"fmt"
	"net/netip"
	"reflect"
	"testing"
)

// TestPrefixListDecodesLikeEncodingJSON: the fast decoder gives the same
// result, or the same error where encoding/json gives one, for the agent's plain
// form and for everything it hands back to encoding/json.
func TestPrefixListDecodesLikeEncodingJSON(t *testing.T) {
	inputs := []string{
		`["10.0.0.0/8","169.254.0.0/16"]`,
		` [ "10.0.0.0/8" , "fd00::/8" ] `,
		`[]`, `[ ]`, `null`,
		`["10.0.0.1/8"]`,              // host bits: ParsePrefix keeps them, as UnmarshalText does
		`["10.0.0.0\/8"]`,             // an escape
		`["\u0031\u0030.0.0.0/8"]`,    // escapes only
		`["10.0.0.0/8",]`, `[,]`, `[`, // malformed
		`["10.0.0.0/33"]`, `["nope"]`, `[1]`, `["10.0.0.0/8" "fd00::/8"]`, `{}`, `"10.0.0.0/8"`,
		`["fe80::1%eth0/64"]`,
	}
	var many []netip.Prefix
	for i := range 1000 {
		many = append(many, netip.PrefixFrom(netip.AddrFrom4([4]byte{10, byte(i >> 8), byte(i), 0}), 24))
	}
	b, _ := json.Marshal(many)
	inputs = append(inputs, string(b))
	for _, in := range inputs {
		var want []netip.Prefix
		wantErr := json.Unmarshal([]byte(in), &want)
		var got prefixList
		gotErr := json.Unmarshal([]byte(in), &got)
		if fmt.Sprint(gotErr) != fmt.Sprint(wantErr) || (wantErr == nil && !reflect.DeepEqual([]netip.Prefix(got), want)) {
			t.Errorf("%.60s: got %v, %v; encoding/json gives %v, %v", in, got, gotErr, want, wantErr)
		}
	}
}

// TestAllocationWireDecodesTheResponse: the client's decoding of a whole
// answer gives the AllocationResponse encoding/json would.
func TestAllocationWireDecodesTheResponse(t *testing.T) {
	for _, cidrs := range [][]netip.Prefix{nil, {netip.MustParsePrefix("10.0.0.0/8"), netip.MustParsePrefix("169.254.0.0/16")}} {
		r := AllocationResponse{IP: netip.MustParseAddr("10.244.1.2"), Owner: "o", RouteTable: 11, NonMasqueradeCIDRs: cidrs, Pool: "10.244.1.0/24"}
		b, _ := json.Marshal(r)
		var want AllocationResponse
		json.Unmarshal(b, &want)
		var w allocationWire
		if err := json.Unmarshal(b, &w); err != nil {
			t.Fatal(err)
		}
		w.AllocationResponse.NonMasqueradeCIDRs = w.NonMasqueradeCIDRs
		if fmt.Sprintf("%#v", w.AllocationResponse) != fmt.Sprintf("%#v", want) {
			t.Errorf("got %#v\nwant %#v", w.AllocationResponse, want)
		}
	}
}

// FuzzPlainIPv4Prefix: what the fast IPv4 parser accepts, netip.ParsePrefix
// parses to the same prefix.
func FuzzPlainIPv4Prefix(f *testing.F) {
	for _, s := range []string{"10.0.0.0/8", "0.0.0.0/0", "255.255.255.255/32", "10.0.0.1/8", "010.0.0.0/8",
		"10.0.0.0/08", "10.0.0.0/33", "256.0.0.0/8", "1.2.3/8", "1.2.3.4.5/8", "1.2.3.4/", "1.2.3.4", "1.2.3.4/8 ", "fd00::/8", "1.2.3.4/8/8", "1111.2.3.4/8"} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, s string) {
		got, n, ok := parsePlainIPv4Prefix([]byte(s))
		if ok && n != len(s) {
			// Stopped early: what it took must be a prefix of its own.
			s = s[:n]
		}
		want, err := netip.ParsePrefix(s)
		if ok && (err != nil || got != want) {
			t.Errorf("%q: fast parser gives %v, ParsePrefix %v, %v", s, got, want, err)
		}
		if !ok && err == nil && want.Addr().Is4() && s == want.String() {
			t.Errorf("%q: the canonical form of %v is refused", s, want)
		}
	})
}

// BenchmarkDecodeAllocation decodes an answer carrying 16 384 IPv4
// prefixes as the client does, against encoding/json over the whole
// answer (the client's decode before the split) in the same run.
func BenchmarkDecodeAllocation(b *testing.B) {
	r := AllocationResponse{IP: netip.MustParseAddr("10.244.1.7"), Owner: "ctr/eth0", RouteTable: 11, Pool: "10.244.1.0/24"}
	for i := range 16384 {
		r.NonMasqueradeCIDRs = append(r.NonMasqueradeCIDRs, netip.PrefixFrom(netip.AddrFrom4([4]byte{10, byte(128 + i>>8), byte(i), 0}), 24))
	}
	answer, _ := json.Marshal(r)
	b.Run("split", func(b *testing.B) {
		for b.Loop() {
			var w allocationWire
			if err := decodeAllocation(answer, &w); err != nil || len(w.NonMasqueradeCIDRs) != 16384 {
				b.Fatal(err)
			}
		}
	})
	b.Run("encoding-json", func(b *testing.B) {
		for b.Loop() {
			var w allocationWire
			if err := json.Unmarshal(answer, &w); err != nil || len(w.NonMasqueradeCIDRs) != 16384 {
				b.Fatal(err)
			}
		}
	})
}
