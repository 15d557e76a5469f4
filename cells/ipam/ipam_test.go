package ipam_test

import (
	"context"
	"fmt"
	"log/slog"
	"net/netip"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/cilium/hive"
	"github.com/cilium/hive/cell"
	"github.com/cilium/hive/hivetest"
	"github.com/cilium/statedb"
	"github.com/spf13/pflag"

	"github.com/ipmasq/ipmasq/agent"
	"github.com/ipmasq/ipmasq/cells/config"
	"github.com/ipmasq/ipmasq/cells/ipam"
	"github.com/ipmasq/ipmasq/cells/podcidrs"
	"github.com/ipmasq/ipmasq/internal/kubeclient"
	"github.com/ipmasq/ipmasq/settings"
	"github.com/ipmasq/ipmasq/tables"
)

type fixture struct {
	ipam   *ipam.IPAM
	db     *statedb.DB
	eps    statedb.Table[*tables.Endpoint]
	health *cell.SimpleHealth
	h      *hive.Hive
}

// startIPAM runs the config and IPAM cells on stateDir with the pool.
func startIPAM(t *testing.T, stateDir string, pool string) (*fixture, error) {
	var f fixture
	f.h = hive.NewWithOptions(agent.Options(),
		agent.Infrastructure, settings.Cell, kubeclient.Cell, config.Cell, podcidrs.Cell, ipam.Cell,
		cell.Invoke(func(i *ipam.IPAM, db *statedb.DB, eps statedb.Table[*tables.Endpoint], h *cell.SimpleHealth) {
			f.ipam, f.db, f.eps, f.health = i, db, eps, h
		}))
	flags := pflag.NewFlagSet("", pflag.ContinueOnError)
	f.h.RegisterFlags(flags)
	if err := flags.Parse([]string{
		"--ip-masq-agent-config-path=" + filepath.Join(t.TempDir(), "none"),
		"--state-dir=" + stateDir, "--pod-cidr=" + pool,
	}); err != nil {
		t.Fatal(err)
	}
	log := hivetest.Logger(t, hivetest.LogLevel(slog.LevelError))
	if err := f.h.Start(log, context.Background()); err != nil {
		return nil, err
	}
	t.Cleanup(func() { f.h.Stop(log, context.Background()) })
	return &f, nil
}

func (f *fixture) healthOf(scope string) string {
	for _, name := range []string{"ipam." + scope} {
		if h := f.health.GetChild(name); h != nil {
			msg := string(h.Level) + ": " + h.Status
			if h.Error != nil {
				msg += ": " + h.Error.Error()
			}
			return msg
		}
	}
	return "no health for " + scope
}

func TestRestoredOutsidePoolsIsKeptAndReported(t *testing.T) {
	dir := t.TempDir()
	store, _ := ipam.NewStore(dir)
	outside := &tables.Endpoint{IP: netip.MustParseAddr("10.9.9.9"), Owner: "old-pod", RouteTable: 11, Created: time.Unix(1, 0).UTC()}
	inside := &tables.Endpoint{IP: netip.MustParseAddr("10.244.1.1"), Owner: "pod", Created: time.Unix(1, 0).UTC()}
	if err := store.Save([]*tables.Endpoint{outside, inside}); err != nil {
		t.Fatal(err)
	}
	f, err := startIPAM(t, dir, "10.244.1.0/24")
	if err != nil {
		t.Fatal(err)
	}
	if n := f.eps.NumObjects(f.db.ReadTxn()); n != 2 {
		t.Fatalf("restored %d endpoints, want 2 (the one outside the pools is kept)", n)
	}
	if h := f.healthOf("state"); !strings.Contains(h, "Degraded") || !strings.Contains(h, "10.9.9.9 (old-pod)") {
		t.Fatalf("health must report the endpoint outside the pools: %s", h)
	}
	// The restored in-pool address is not handed out again.
	a, err := f.ipam.Allocate(context.Background(), ipam.Request{Owner: "new", Family: tables.IPv4})
	if err != nil || a.Endpoint.IP.String() == "10.244.1.1" {
		t.Fatalf("allocation: %+v %v", a, err)
	}
}

func TestUnreadableStateRefusesToStart(t *testing.T) {
	dir := t.TempDir()
	if err := os.WriteFile(filepath.Join(dir, "endpoints.json"), []byte(`{"version":1,"endpoints":[`), 0o600); err != nil {
		t.Fatal(err)
	}
	_, err := startIPAM(t, dir, "10.244.1.0/24")
	if err == nil || !strings.Contains(err.Error(), "endpoints.json") || !strings.Contains(err.Error(), "starting empty would hand out addresses in use") {
		t.Fatalf("want a start error naming the state file, got %v", err)
	}
}

func TestPersistFailureKeepsTableAndDisk(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "state")
	f, err := startIPAM(t, dir, "10.244.1.0/24")
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	if _, err := f.ipam.Allocate(ctx, ipam.Request{Owner: "a", Family: tables.IPv4}); err != nil {
		t.Fatal(err)
	}
	// The state directory becomes unusable (a file where it was).
	if err := os.Rename(dir, dir+".moved"); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(dir, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	_, err = f.ipam.Allocate(ctx, ipam.Request{Owner: "b", Family: tables.IPv4})
	if err == nil || !strings.Contains(err.Error(), "persist endpoints") {
		t.Fatalf("allocation with an unusable state dir: want a persist error, got %v", err)
	}
	if _, err := f.ipam.Release(netip.MustParseAddr("10.244.1.1")); err == nil {
		t.Fatal("release with an unusable state dir must fail, not forget the address on disk")
	}
	if n := f.eps.NumObjects(f.db.ReadTxn()); n != 1 {
		t.Fatalf("the table must not run ahead of the disk: %d endpoints", n)
	}
	if h := f.healthOf("state"); !strings.Contains(h, "Degraded") {
		t.Fatalf("health: %s", h)
	}
	os.Remove(dir)
	if err := os.Rename(dir+".moved", dir); err != nil {
		t.Fatal(err)
	}
	if _, err := f.ipam.Allocate(ctx, ipam.Request{Owner: "b", Family: tables.IPv4}); err != nil {
		t.Fatalf("after the directory is back: %v", err)
	}
	if h := f.healthOf("state"); !strings.Contains(h, "OK") {
		t.Fatalf("health after recovery: %s", h)
	}
}

// Allocations and releases at once, then a restart: every acknowledged
// change is restored, and the start compacts the journal into the snapshot.
func TestConcurrentAllocationsSurviveRestart(t *testing.T) {
	dir := t.TempDir()
	f, err := startIPAM(t, dir, "10.244.1.0/24")
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	var wg sync.WaitGroup
	for w := range 8 {
		wg.Go(func() {
			for i := range 10 {
				a, err := f.ipam.Allocate(ctx, ipam.Request{Owner: fmt.Sprintf("w%d-%d", w, i), Family: tables.IPv4})
				if err != nil {
					t.Error(err)
					return
				}
				if i%4 == 0 {
					if _, err := f.ipam.Release(a.Endpoint.IP); err != nil {
						t.Error(err)
					}
				}
			}
		})
	}
	wg.Wait()
	want := f.ipam.List()
	if len(want) != 8*(10-3) {
		t.Fatalf("%d endpoints, want %d", len(want), 8*(10-3))
	}
	if err := f.h.Stop(hivetest.Logger(t), ctx); err != nil {
		t.Fatal(err)
	}

	f, err = startIPAM(t, dir, "10.244.1.0/24")
	if err != nil {
		t.Fatal(err)
	}
	if got := f.ipam.List(); !slices.Equal(got, want) {
		t.Fatalf("after restart:\n%v\nwant\n%v", got, want)
	}
	if fi, err := os.Stat(filepath.Join(dir, "endpoints.journal")); err != nil || fi.Size() != 0 {
		t.Errorf("journal after the start's compaction: %v %v, want empty", fi, err)
	}
	if h := f.healthOf("compaction"); !strings.Contains(h, "OK") {
		t.Errorf("compaction health: %s", h)
	}
}

func TestCorruptJournalRefusesToStart(t *testing.T) {
	dir := t.TempDir()
	journal := `00000000 {"seq":1,"op":"del","ip":"10.244.1.1"}` + "\n" + `00000000 {"seq":2,"op":"del","ip":"10.244.1.2"}` + "\n"
	if err := os.WriteFile(filepath.Join(dir, "endpoints.journal"), []byte(journal), 0o600); err != nil {
		t.Fatal(err)
	}
	_, err := startIPAM(t, dir, "10.244.1.0/24")
	if err == nil || !strings.Contains(err.Error(), "endpoints.journal line 1: checksum mismatch") ||
		!strings.Contains(err.Error(), "starting empty would hand out addresses in use") {
		t.Fatalf("want a start error naming the journal line, got %v", err)
	}
}
