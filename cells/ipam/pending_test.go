package ipam_test

import (
	"context"
	"net/netip"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/ipmasq/ipmasq/cells/ipam"
	"github.com/ipmasq/ipmasq/internal/agentlock"
	"github.com/ipmasq/ipmasq/ipamapi"
	"github.com/ipmasq/ipmasq/settings"
	"github.com/ipmasq/ipmasq/tables"
)

// TestPendingReleasesAtStart: the releases ipmasq-cni recorded while the
// agent was away are done in the start hook (before anything can ask for
// an address), their records removed; a record of an owner that holds
// nothing is removed too; a record that is not what its name says is
// kept and reported, its owner's address kept.
func TestPendingReleasesAtStart(t *testing.T) {
	dir := t.TempDir()
	store, _ := ipam.NewStore(dir)
	if err := store.Save([]*tables.Endpoint{
		{IP: netip.MustParseAddr("10.244.1.2"), Owner: "c1/eth0", Created: time.Unix(1, 0).UTC()},
		{IP: netip.MustParseAddr("10.244.1.3"), Owner: "c2/eth0", Created: time.Unix(1, 0).UTC()},
		{IP: netip.MustParseAddr("10.244.1.4"), Owner: "c3/eth0", Created: time.Unix(1, 0).UTC()},
	}); err != nil {
		t.Fatal(err)
	}
	store.Close()
	// The agent ran here: the plugin records releases only then.
	os.WriteFile(filepath.Join(dir, ipamapi.AgentLockName), nil, 0o600)
	for _, o := range []string{"c1/eth0", "gone/eth0", "c3/eth0"} {
		if err := ipamapi.WritePendingRelease(dir, o); err != nil {
			t.Fatal(err)
		}
	}
	torn := ipamapi.PendingReleaseFile(ipamapi.PendingReleaseDir(dir), "c3/eth0")
	os.WriteFile(torn, []byte("c2/eth0\n"), 0o600)

	f, err := startIPAM(t, dir, "10.244.1.0/24")
	if err != nil {
		t.Fatal(err)
	}
	var owners []string
	for _, ep := range f.ipam.List() {
		owners = append(owners, ep.Owner)
	}
	if strings.Join(owners, " ") != "c2/eth0 c3/eth0" {
		t.Fatalf("endpoints after start: %v; want c1 released, c2 and c3 kept", owners)
	}
	recs, err := ipamapi.PendingReleases(dir)
	if len(recs) != 0 || err == nil || !strings.Contains(err.Error(), `holds "c2/eth0\n", not its owner "c3/eth0"`) {
		t.Fatalf("records after start: %v, %v; want only the torn one, reported", recs, err)
	}
	if h := f.healthOf("pending-releases"); !strings.HasPrefix(h, "Degraded") {
		t.Fatalf("health %q", h)
	}
}

// TestAllocateAfterPendingRelease: an ADD of an owner whose DEL was
// recorded (the agent was unreachable in between) gets a fresh
// allocation, the recorded release done first, not the address the DEL
// gave up.
func TestAllocateAfterPendingRelease(t *testing.T) {
	dir := t.TempDir()
	f, err := startIPAM(t, dir, "10.244.1.0/24")
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	a, err := f.ipam.Allocate(ctx, ipam.Request{Owner: "c1/eth0", Family: tables.IPv4})
	if err != nil {
		t.Fatal(err)
	}
	os.WriteFile(filepath.Join(dir, ipamapi.AgentLockName), nil, 0o600)
	if err := ipamapi.WritePendingRelease(dir, "c1/eth0"); err != nil {
		t.Fatal(err)
	}
	b, err := f.ipam.Allocate(ctx, ipam.Request{Owner: "c1/eth0", Family: tables.IPv4})
	if err != nil {
		t.Fatal(err)
	}
	if !b.Created {
		t.Fatalf("ADD after a recorded DEL got the old allocation %s back", a.Endpoint.IP)
	}
	if recs, err := ipamapi.PendingReleases(dir); len(recs) != 0 || err != nil {
		t.Fatalf("records after the ADD: %v, %v", recs, err)
	}
}

// TestPendingReleaseContract: the plugin's copies of the agent's names.
func TestPendingReleaseContract(t *testing.T) {
	if ipamapi.AgentLockName != agentlock.FileName {
		t.Errorf("ipamapi.AgentLockName %q, agentlock.FileName %q", ipamapi.AgentLockName, agentlock.FileName)
	}
	if ipamapi.DefaultStateDir != settings.Default.StateDir {
		t.Errorf("ipamapi.DefaultStateDir %q, --state-dir default %q", ipamapi.DefaultStateDir, settings.Default.StateDir)
	}
}
