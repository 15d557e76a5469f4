package ipam

import (
	"fmt"
	"testing"

	"github.com/ipmasq/ipmasq/tables"
)

// TestCompactionThresholdGrowsWithTheState: a compaction writes every
// endpoint, so once the state holds more than twice compactRecords
// endpoints it is due after half as many records as there are endpoints,
// and the byte threshold grows by the same factor; a small state keeps
// the fixed thresholds (TestCompactionThreshold).
func TestCompactionThresholdGrowsWithTheState(t *testing.T) {
	s := loaded(t)
	saveResidents(t, s, 20, "resident-%d")
	// One address allocated and released in turn: 20 or 21 endpoints,
	// so records are due after 10 of them, bytes after 10/4 × compactBytes.
	change := func(k int) { churn(t, s, k, "churn") }

	s.compactRecords, s.compactBytes = 4, 1<<20
	for k := 1; k <= 10; k++ {
		change(k)
		if s.NeedsCompaction() {
			t.Fatalf("NeedsCompaction after %d records with 20 endpoints: the threshold is 10, not compactRecords 4", k)
		}
	}
	change(11)
	if !s.NeedsCompaction() {
		t.Fatal("no NeedsCompaction after 11 records with 21 endpoints (threshold 10)")
	}

	if err := s.Compact(); err != nil {
		t.Fatal(err)
	}
	s.compactBytes = 300 // grown: 300 × 10/4 = 750 bytes
	for k := 12; ; k++ {
		change(k)
		if due := s.NeedsCompaction(); s.size <= 750 && s.records <= 10 {
			if due {
				t.Fatalf("NeedsCompaction with a %d-byte journal of %d records: the byte threshold is 750, not compactBytes 300", s.size, s.records)
			}
			continue
		} else if !due {
			t.Fatalf("no NeedsCompaction with a %d-byte journal of %d records (thresholds 750 bytes, 10 records)", s.size, s.records)
		}
		if s.records < 3 {
			t.Fatalf("a journal of %d records is over 750 bytes: the test's lines are longer than it assumes", s.records)
		}
		break
	}
}

// TestCompactionKeepsNoRecordsInMemory: the store counts the journal's
// records but keeps none of them, except those appended while a
// compaction writes its snapshot (they go into the new journal).
func TestCompactionKeepsNoRecordsInMemory(t *testing.T) {
	s := loaded(t)
	save(t, s, sampleA())
	add(t, s, ep("10.244.1.9", "y", 0, t0))
	del(t, s, "10.244.1.9")
	if s.records != 2 || s.tail != nil {
		t.Fatalf("records %d, tail %d lines; want 2 records and no lines kept", s.records, len(s.tail))
	}
	if err := s.Compact(); err != nil {
		t.Fatal(err)
	}
	if s.records != 0 || s.size != 0 || s.tail != nil || s.compacting {
		t.Fatalf("after Compact: records %d, size %d, tail %d, compacting %v", s.records, s.size, len(s.tail), s.compacting)
	}
}

// TestCompactionDefaultThreshold: with the default thresholds, a small
// state (100 endpoints) is compacted after 2 048 records of an
// allocate/release loop, not before (a compaction every 128 allocations
// delayed the allocations behind its journal cut), and a restart replays
// a journal that long.
func TestCompactionDefaultThreshold(t *testing.T) {
	s := loaded(t)
	saveResidents(t, s, 100, "resident-%d/eth0")
	const owner = "0123456789abcdef0123456789abcdef/eth0"
	for k := 1; k <= 2048; k++ {
		churn(t, s, k, owner)
		if s.NeedsCompaction() {
			t.Fatalf("NeedsCompaction after %d records (%d bytes) with 100 endpoints: the default threshold is 2048 records", k, s.size)
		}
	}
	churn(t, s, 2049, owner)
	if !s.NeedsCompaction() {
		t.Fatal("no NeedsCompaction after 2049 records with 100 endpoints")
	}
	eps, rep := reopen(t, s)
	if len(eps) != 101 || rep.Replayed != 2049 {
		t.Errorf("restart: %d endpoints, %d records replayed; want 101, 2049", len(eps), rep.Replayed)
	}
}

// saveResidents saves n endpoints, 10.244.2.1 and up, owned by
// fmt.Sprintf(owner, i).
func saveResidents(t *testing.T, s *Store, n int, owner string) {
	t.Helper()
	var residents []*tables.Endpoint
	for i := range n {
		residents = append(residents, ep(fmt.Sprintf("10.244.2.%d", i+1), fmt.Sprintf(owner, i), 0, t0))
	}
	save(t, s, residents)
}

// churn is change k of a loop that allocates 10.244.3.1 to owner (odd k)
// and releases it (even k).
func churn(t *testing.T, s *Store, k int, owner string) {
	t.Helper()
	if k%2 == 1 {
		add(t, s, ep("10.244.3.1", owner, 0, t0))
	} else {
		del(t, s, "10.244.3.1")
	}
}
