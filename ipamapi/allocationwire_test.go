package ipamapi

import (
	"bytes"
	"encoding/json"
	"fmt"
	"net/netip"
	"strings"
	"testing"
	"time"
)

// wholeDecode is how the client decoded an answer before decodeAllocation:
// encoding/json over the whole body.
func wholeDecode(b []byte) (allocationWire, error) {
	var w allocationWire
	err := json.NewDecoder(bytes.NewReader(b)).Decode(&w)
	return w, err
}

// allocationAnswers are answers as the agent writes them and variants of
// them that the split must either decode the same way or leave to
// encoding/json.
func allocationAnswers() []string {
	r := AllocationResponse{
		IP: netip.MustParseAddr("10.244.1.7"), Owner: `ctr-<1>&"x"/eth0`, RouteTable: 11,
		Created:            time.Date(2026, 11, 30, 13, 0, 0, 0, time.UTC),
		NonMasqueradeCIDRs: []netip.Prefix{netip.MustParsePrefix("10.0.0.0/8"), netip.MustParsePrefix("169.254.0.0/16")},
		Pool:               "10.244.1.0/24",
	}
	enc := func(r AllocationResponse) string {
		var b bytes.Buffer
		json.NewEncoder(&b).Encode(r)
		return b.String()
	}
	noPool := r
	noPool.Pool = ""
	noCIDRs := r
	noCIDRs.NonMasqueradeCIDRs = nil
	v6 := r
	v6.IP = netip.MustParseAddr("fd00:10:244:1::7")
	v6.NonMasqueradeCIDRs = []netip.Prefix{netip.MustParsePrefix("fd00::/8"), netip.MustParsePrefix("fe80::/10")}
	v6.Pool = "fd00:10:244:1::/64"
	trap := r
	trap.Owner = `x,"nonMasqueradeCIDRs":["1.2.3.0/24"]}`
	var many []netip.Prefix
	for i := range 5000 {
		many = append(many, netip.PrefixFrom(netip.AddrFrom4([4]byte{10, byte(i >> 8), byte(i), 0}), 24))
	}
	large := r
	large.NonMasqueradeCIDRs = many

	agent := enc(r)
	return []string{
		agent, enc(noPool), enc(noCIDRs), enc(v6), enc(trap), enc(large),
		// Spaces JSON allows, and one it does not (U+00A0) next to the split.
		strings.Replace(agent, `,"nonMasqueradeCIDRs":[`, " \n,\"nonMasqueradeCIDRs\":[ ", 1),
		strings.Replace(agent, `],"pool"`, "] ,\"pool\"", 1),
		strings.Replace(agent, `,"nonMasqueradeCIDRs":[`, "\u00a0,\"nonMasqueradeCIDRs\":[", 1),
		strings.Replace(agent, `],"pool"`, "]\u00a0,\"pool\"", 1),
		// The key first: no member before the split.
		`{,"nonMasqueradeCIDRs":["10.0.0.0/8"],"ip":"10.244.1.7"}`,
		`{"nonMasqueradeCIDRs":["10.0.0.0/8"],"ip":"10.244.1.7"}`,
		// The key inside a nested value, and twice.
		`{"ip":"10.244.1.7","x":{"a":1,"nonMasqueradeCIDRs":["1.2.3.0/24"]},"nonMasqueradeCIDRs":["10.0.0.0/8"]}`,
		`{"ip":"10.244.1.7","x":[{"a":1,"nonMasqueradeCIDRs":["1.2.3.0/24"]}],"pool":"p"}`,
		`{"ip":"10.244.1.7","nonMasqueradeCIDRs":["1.2.3.0/24"],"nonMasqueradeCIDRs":["10.0.0.0/8"]}`,
		`{"ip":"10.244.1.7","nonMasqueradeCIDRs":["10.0.0.0/8"],"NONMASQUERADECIDRS":["1.2.3.0/24"]}`,
		// Lists the plain parser refuses, and broken answers.
		`{"ip":"10.244.1.7","nonMasqueradeCIDRs":["10.0.0.0\/8"]}`,
		`{"ip":"10.244.1.7","nonMasqueradeCIDRs":["10.0.0.0/8]"]}`,
		`{"ip":"10.244.1.7","nonMasqueradeCIDRs":["10.0.0.0/8"`,
		`{"ip":"10.244.1.7","nonMasqueradeCIDRs":["nope"]}`,
		`{"ip":"10.244.1.7","nonMasqueradeCIDRs":[1]}`,
		`{"ip":"10.244.1.7","nonMasqueradeCIDRs":[]}`,
		`{"ip":"nope","nonMasqueradeCIDRs":["10.0.0.0/8"]}`,
		`{"ip":"10.244.1.7","nonMasqueradeCIDRs":["10.0.0.0/8"],"pool":}`,
		`{"ip":"10.244.1.7","nonMasqueradeCIDRs":["10.0.0.0/8"],}`,
		`{"ip":"10.244.1.7","nonMasqueradeCIDRs":["10.0.0.0/8"]} trailing`,
		`{"ip":"10.244.1.7","nonMasqueradeCIDRs":["10.0.0.0/8"],"pool":"p"} {}`,
		`{"ip":"10.244.1.7","nonMasqueradeCIDRs":["10.0.0.0/8"]`,
		`{"ip":"10.244.1.7","nonMasqueradeCIDRs":["10.0.0.0/8"]]}`,
		`{"ip":"10.244.1.7","routeTable":-1,"nonMasqueradeCIDRs":["10.0.0.0/8"]}`,
		`[{"ip":"10.244.1.7","nonMasqueradeCIDRs":["10.0.0.0/8"]}]`,
		`{"ip":"10.244.1.7\xff","nonMasqueradeCIDRs":["10.0.0.0/8"]}`,
		``, `null`, `{}`,
	}
}

// TestDecodeAllocationDecodesLikeEncodingJSON: the client's split decode
// of an answer gives what encoding/json gives for the whole answer, the
// same value or the same error, for the agent's form and for every variant
// the split must refuse.
func TestDecodeAllocationDecodesLikeEncodingJSON(t *testing.T) {
	for _, in := range allocationAnswers() {
		checkDecodeAllocation(t, []byte(in))
	}
}

// TestDecodeAllocationSplitsTheAgentsAnswer: the agent's own answers take
// the split path (else the fast path would never run and the test above
// would pass without it).
func TestDecodeAllocationSplitsTheAgentsAnswer(t *testing.T) {
	for _, in := range allocationAnswers()[:6] {
		if in == "" || !strings.Contains(in, "nonMasqueradeCIDRs") {
			continue
		}
		var w allocationWire
		if !decodeAllocationSplit([]byte(in), &w) {
			t.Errorf("the split did not apply to the agent's answer %.80s", in)
		}
	}
}

func FuzzDecodeAllocation(f *testing.F) {
	for _, in := range allocationAnswers() {
		f.Add([]byte(in))
	}
	f.Fuzz(func(t *testing.T, b []byte) { checkDecodeAllocation(t, b) })
}

func checkDecodeAllocation(t *testing.T, in []byte) {
	t.Helper()
	want, wantErr := wholeDecode(in)
	var got allocationWire
	gotErr := decodeAllocation(in, &got)
	if fmt.Sprint(gotErr) != fmt.Sprint(wantErr) {
		t.Errorf("%.100q: error %v, encoding/json gives %v", in, gotErr, wantErr)
		return
	}
	if wantErr == nil && fmt.Sprintf("%#v", got) != fmt.Sprintf("%#v", want) {
		t.Errorf("%.100q:\ngot  %#v\nwant %#v", in, got, want)
	}
}
