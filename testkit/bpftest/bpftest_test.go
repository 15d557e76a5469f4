package bpftest

import (
	"encoding/binary"
	"testing"

	"github.com/cilium/ebpf"

	"github.com/ipmasq/ipmasq/bpf"
)

// TestNonMasqV4: the trie has the size asked for and the key and value of
// the datapath's nonmasq tries.
func TestNonMasqV4(t *testing.T) {
	m := NonMasqV4(t, 128)
	if m.Type() != ebpf.LPMTrie || m.MaxEntries() != 128 ||
		int(m.KeySize()) != binary.Size(bpf.LPMKeyV4{}) || m.ValueSize() != 1 {
		t.Fatalf("trie %v: type %v, %d entries, key %d B, value %d B; want an LPM trie of 128, key %d B, value 1 B",
			m, m.Type(), m.MaxEntries(), m.KeySize(), m.ValueSize(), binary.Size(bpf.LPMKeyV4{}))
	}
}
