package config

import (
	"reflect"
	"strings"
	"testing"
)

// fastJSONSeeds are JSON files the fast path must decode exactly as
// encoding/json does, or decline.
var fastJSONSeeds = []string{
	`{}`,
	`{ }`,
	`{"nonMasqueradeCIDRs": ["10.0.0.0/8", "fd00::/8"], "masqLinkLocal": true, "masqLinkLocalIPv6": false}`,
	`{"nonMasqueradeCIDRs": []}`,
	`{"nonMasqueradeCIDRs": [ ]}`,
	`{"nonMasqueradeCIDRs": null}`,
	`{"masqueradeCIDRs": null, "nonMasqueradeCIDRs": ["10.0.0.0/8"]}`,
	`{"masqueradeCIDRs": []}`,
	"{\n\t\"resyncInterval\": \"60s\",\r\n \"cidrLimit\": 100\n}",
	`{"cidrLimit": 0}`,
	`{"cidrLimit": -1}`,
	`{"cidrLimit": 007}`,
	`{"cidrLimit": 1e3}`,
	`{"cidrLimit": 1.5}`,
	`{"cidrLimit": 12345678901234567890}`,
	`{"resyncInterval": null}`,
	`{"masqLinkLocal": null}`,
	`{"masqLinkLocal": "true"}`,
	`{"nonMasqueradeCIDRs": ["10.0.0.0\/8"]}`,
	`{"nonMasqueradeCIDRs": ["10.0.0.0/8\u0000"]}`,
	"{\"nonMasqueradeCIDRs\": [\"10.0.0.0/8\xff\"]}",
	"{\"nonMasqueradeCIDRs\": [\"10.0.0.0/8\x7f\"]}",
	`{"nonMasqueradeCIDRs": ["10.0.0.0/8",]}`,
	`{"nonMasqueradeCIDRs": ["10.0.0.0/8"],}`,
	`{"nonMasqueradeCIDRs": ["10.0.0.0/8"] "masqLinkLocal": true}`,
	`{"nonMasqueradeCIDRs": [10]}`,
	`{"nonMasqueradeCIDRs": "10.0.0.0/8"}`,
	`{"nonmasqueradecidrs": ["10.0.0.0/8"]}`,
	`{"masqLinkLocal": true, "masqLinkLocal": false}`,
	`{"foo": 1}`,
	`{"masqueradeRules": [{"name": "a", "sources": ["10.8.0.0/24"], "outInterfaces": ["eth0"]}]}`,
	`{"masqLinkLocal": true} {}`,
	`{"masqLinkLocal": true`,
	`{"nonMasqueradeCIDRs": ["10.0.0.0/8"`,
	`{"nonMasqueradeCIDRs": ["10.0.0.0/8]}`,
	`{"masqLinkLocal": tru}`,
}

// checkFastJSON decodes data with the fast path and with encoding/json
// (decodeJSON without the fast path) and fails when the fast path accepts
// something encoding/json decodes differently or rejects.
func checkFastJSON(t *testing.T, data []byte) {
	t.Helper()
	newRaw := func() (*rawFile, *[]string) {
		absent := new([]string)
		return &rawFile{NonMasqueradeCIDRs: absent}, absent
	}
	fast, fastAbsent := newRaw()
	if !fastDecodeJSON(data, fast) {
		if want, _ := newRaw(); !reflect.DeepEqual(fast, want) {
			t.Fatalf("declined %q but changed raw: %+v", data, fast)
		}
		return
	}
	slow, slowAbsent := newRaw()
	if _, err := decodeWithEncodingJSON("test.json", data, slow, slowAbsent, true); err != nil {
		t.Fatalf("fast path accepted %q, encoding/json rejects it: %v", data, err)
	}
	// The sentinel pointer: replaced by nil for null, kept otherwise.
	if (fast.NonMasqueradeCIDRs == fastAbsent) != (slow.NonMasqueradeCIDRs == slowAbsent) {
		t.Fatalf("%q: nonMasqueradeCIDRs pointer differs: fast %v, encoding/json %v", data, fast.NonMasqueradeCIDRs, slow.NonMasqueradeCIDRs)
	}
	fast.NonMasqueradeCIDRs, slow.NonMasqueradeCIDRs = nil, nil
	if !reflect.DeepEqual(fast, slow) || !reflect.DeepEqual(*fastAbsent, *slowAbsent) {
		t.Fatalf("%q: fast path %+v %#v, encoding/json %+v %#v", data, fast, *fastAbsent, slow, *slowAbsent)
	}
}

// TestFastJSONMatchesDecoder: for every seed, the fast path decodes
// exactly what encoding/json decodes, or declines.
func TestFastJSONMatchesDecoder(t *testing.T) {
	accepted := 0
	for _, s := range fastJSONSeeds {
		checkFastJSON(t, []byte(s))
		raw := rawFile{NonMasqueradeCIDRs: new([]string)}
		if fastDecodeJSON([]byte(s), &raw) {
			accepted++
		}
	}
	// The common shapes must take the fast path, or it is useless.
	for _, s := range []string{fastJSONSeeds[0], fastJSONSeeds[2], fastJSONSeeds[5], fastJSONSeeds[8]} {
		raw := rawFile{NonMasqueradeCIDRs: new([]string)}
		if !fastDecodeJSON([]byte(s), &raw) {
			t.Errorf("fast path declined %q", s)
		}
	}
	big := `{"masqLinkLocal": true, "nonMasqueradeCIDRs": ["` + strings.Join(genCIDRs(16384), `", "`) + `"]}`
	checkFastJSON(t, []byte(big))
	if raw := (rawFile{NonMasqueradeCIDRs: new([]string)}); !fastDecodeJSON([]byte(big), &raw) || len(*raw.NonMasqueradeCIDRs) != 16384 {
		t.Fatal("fast path declined or shortened a 16 384-prefix file")
	}
	t.Logf("fast path took %d of %d seeds", accepted, len(fastJSONSeeds))
}

func FuzzFastJSON(f *testing.F) {
	for _, s := range fastJSONSeeds {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, data []byte) {
		checkFastJSON(t, data)
	})
}

// TestFastJSONListAllocatesOnce: the strings of a list are slices of one
// copy of the file, not one allocation each (issue #14).
func TestFastJSONListAllocatesOnce(t *testing.T) {
	list := genCIDRs(1000)
	data := []byte(`{"masqLinkLocal": true, "nonMasqueradeCIDRs": ["` + strings.Join(list, `", "`) + `"]}`)
	var raw rawFile
	allocs := testing.AllocsPerRun(10, func() {
		raw = rawFile{NonMasqueradeCIDRs: new([]string)}
		if !fastDecodeJSON(data, &raw) {
			t.Fatal("fast path declined a plain list")
		}
	})
	if got := *raw.NonMasqueradeCIDRs; !reflect.DeepEqual(got, list) {
		t.Fatalf("decoded %d prefixes, want the %d listed", len(got), len(list))
	}
	if allocs > 20 {
		t.Errorf("decoding %d prefixes made %.0f allocations; want a handful, not one per prefix", len(list), allocs)
	}
}
