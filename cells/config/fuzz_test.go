package config

import (
	"reflect"
	"slices"
	"strings"
	"testing"
)

func FuzzParse(f *testing.F) {
	seeds := []string{
		"",
		"   \n",
		"# comment only\n",
		"---\n",
		"{}",
		"nonMasqueradeCIDRs:\n  - 10.0.0.0/8\n  - fd00::/8\nmasqLinkLocal: true\nresyncInterval: 60s\n",
		`{"nonMasqueradeCIDRs": ["10.0.0.0/8", "10.0.0.0/8"], "masqueradeCIDRs": ["10.1.0.0/16"], "cidrLimit": 10}`,
		"nonMasqueradeCIDRs: []\nmasqueradeCIDRs: [169.254.0.0/16, 10.0.0.0/8]\n",
		"nonMasqueradeCIDRs:\n",
		`{"nonMasqueradeCIDRs": null, "masqLinkLocalIPv6": true}`,
		"{nonMasqueradeCIDRs: [10.0.0.0/8]}",
		"masqueradeRules:\n- name: wg\n  sources: [10.8.0.0/24]\n  outInterfaces: [eth0, wg+]\n  toAddress: 192.0.2.1\n",
		`{"masqueradeRules": [{"name": "v6", "sources": ["fd00::/64"], "outInterfaces": ["eth0"], "toAddress": "fd00::1"}]}`,
		// invalid ones
		"nonMasqueradeCIDRs: [10.0.0.1/8]\n",
		"nonMasqueradeCIDRs: [10.0.0/8]\n",
		`{"nonMasqueradeCIDRs": ["::ffff:10.0.0.0/104"]}`,
		"foo: 1\n",
		// unknown keys: ignored, the known ones apply
		"resyncIntervall: 60s\nnonMasqueradeCIDRs: [10.0.0.0/8]\n",
		`{"b": [1, {"c": null}], "nonMasqueradeCIDRs": ["10.0.0.0/8"], "a": 1}`,
		"foo: 1\nmasqueradeRules:\n- name: a\n  sources: [10.8.0.0/24]\n  outInterfaces: [eth0]\n  bar: 2\n",
		"resyncIntervall: 1\nmasqLinkLocal: \"yes\"\n",
		`{"a": 1, "a": 2}`,
		`{"masqLinkLocal": true} x`,
		"masqLinkLocal: true\n---\nmasqLinkLocal: false\n",
		"nonMasqueradeCIDRs: [10.0.0.0/8]\nmasqueradeCIDRs: [10.0.0.0/8]\n",
		"resyncInterval: 0s\ncidrLimit: 0\n",
		"masqueradeRules:\n- name: a\n  sources: [fd00::/64]\n  outInterfaces: [\"a+b\"]\n  toAddress: 10.0.0.1\n",
		"- 1\n- 2\n",
		`{"nonMasqueradeCIDRs": [`,
	}
	for _, s := range seeds {
		f.Add([]byte(s), uint8(3), uint8(4))
	}
	addHostileSeeds(f)
	f.Fuzz(func(t *testing.T, data []byte, families, max uint8) {
		lim := Limits{EnableIPv4: families&1 != 0, EnableIPv6: families&2 != 0, MaxCIDRsPerFamily: int(max % 32)}
		file, err := Parse("fuzz.yaml", data, lim)
		file2, err2 := Parse("fuzz.yaml", data, lim)
		if (err == nil) != (err2 == nil) || (err != nil && err.Error() != err2.Error()) {
			t.Fatalf("Parse is not deterministic: %v vs %v", err, err2)
		}
		if !reflect.DeepEqual(file, file2) {
			t.Fatalf("Parse is not deterministic: %+v vs %+v", file, file2)
		}
		if err != nil {
			if file != nil {
				t.Fatalf("Parse returned a File with error %v", err)
			}
			if msg := err.Error(); !strings.HasPrefix(msg, "fuzz.yaml: ") || strings.ContainsAny(msg, "\r\n") {
				t.Fatalf("error is not one line starting with the file name: %q", hostileShorten(msg))
			}
			return
		}
		// Unknown keys are reported once each, sorted, and none of them
		// is a key of the format (in any case: encoding/json matches
		// keys case-insensitively).
		if !slices.IsSorted(file.UnknownKeys) || len(slices.Compact(slices.Clone(file.UnknownKeys))) != len(file.UnknownKeys) {
			t.Fatalf("unknown keys %q are not sorted and unique", file.UnknownKeys)
		}
		for _, k := range file.UnknownKeys {
			for _, known := range jsonKeys[rawFile]() {
				if strings.EqualFold(k, known) {
					t.Fatalf("known key %q reported as unknown", k)
				}
			}
		}
		es := file.Entries(lim)
		checkEntries(t, file, lim, es)
		if !reflect.DeepEqual(es, file.Entries(lim)) {
			t.Fatal("Entries is not deterministic")
		}
	})
}
