package config_test

import (
	"context"
	"fmt"
	"log/slog"
	"net/netip"
	"os"
	"path/filepath"
	"slices"
	"testing"
	"time"

	"github.com/cilium/hive"
	"github.com/cilium/hive/cell"
	"github.com/cilium/hive/hivetest"
	"github.com/cilium/hive/job"
	"github.com/cilium/statedb"

	"github.com/ipmasq/ipmasq/cells/config"
	"github.com/ipmasq/ipmasq/settings"
	"github.com/ipmasq/ipmasq/tables"
)

// foreignIPAM stands for a bigger agent's own IPAM: it reads the
// no-masquerade CIDRs in its start hook, with no knowledge of the config
// cell's place in the hive.
type foreignIPAM struct {
	cidrs []netip.Prefix
}

func foreignIPAMCell(out *foreignIPAM) cell.Cell {
	return cell.Module("foreign-ipam", "IPAM of a bigger agent",
		cell.Invoke(func(lc cell.Lifecycle, db *statedb.DB, tbl statedb.Table[*tables.NonMasqCIDR]) {
			lc.Append(cell.Hook{OnStart: func(ctx cell.HookContext) error {
				txn, err := tables.WaitForConfig(ctx, db, tbl)
				if err != nil {
					return err
				}
				out.cidrs = tables.NoMasqueradePrefixes(txn, tbl, tables.IPv4)
				return nil
			}})
		}))
}

// newForeignHive embeds only the config cell and what it needs, with the
// foreign cell before or after it.
func newForeignHive(path string, foreignFirst bool, out *foreignIPAM) *hive.Hive {
	ipmasq := []cell.Cell{settings.Cell, config.Cell}
	foreign := foreignIPAMCell(out)
	cells := append([]cell.Cell{statedb.Cell, job.Cell, cell.SimpleHealthCell}, append(ipmasq, foreign)...)
	if foreignFirst {
		cells = append([]cell.Cell{statedb.Cell, job.Cell, cell.SimpleHealthCell, foreign}, ipmasq...)
	}
	h := hive.New(cells...)
	hive.AddConfigOverride(h, func(c *config.Config) { c.IPMasqAgentConfigPath = path })
	return h
}

func writeFile(t testing.TB, path, content string) {
	t.Helper()
	if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(path+".tmp", []byte(content), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.Rename(path+".tmp", path); err != nil {
		t.Fatal(err)
	}
}

// TestEmbeddingCellOrder: whatever the order of the cells, the foreign
// start hook sees the loaded config, never an empty or default one.
func TestEmbeddingCellOrder(t *testing.T) {
	want := []netip.Prefix{
		netip.MustParsePrefix("10.0.0.0/8"),
		netip.MustParsePrefix("192.168.0.0/16"),
	}
	for _, foreignFirst := range []bool{true, false} {
		t.Run(fmt.Sprintf("foreign-first=%v", foreignFirst), func(t *testing.T) {
			path := filepath.Join(t.TempDir(), "ip-masq-agent")
			writeFile(t, path, "nonMasqueradeCIDRs: [192.168.0.0/16, 10.0.0.0/8]\nmasqLinkLocal: true\n")
			var got foreignIPAM
			h := newForeignHive(path, foreignFirst, &got)
			log := hivetest.Logger(t)
			if err := h.Start(log, context.Background()); err != nil {
				t.Fatal(err)
			}
			defer h.Stop(log, context.Background())
			if !slices.Equal(got.cidrs, want) {
				t.Fatalf("foreign start hook read %v, want %v", got.cidrs, want)
			}
		})
	}
}

// TestEmbeddingWaitsForGoodConfig: with an invalid first file the foreign
// start hook waits (the table is not initialized) and gets the first good
// config, not an empty list.
func TestEmbeddingWaitsForGoodConfig(t *testing.T) {
	path := filepath.Join(t.TempDir(), "ip-masq-agent")
	writeFile(t, path, "nonMasqueradeCIDRs: [10.0.0.1/8]\n")
	var got foreignIPAM
	// Config first so its watcher job runs while the foreign hook waits.
	h := newForeignHive(path, false, &got)
	log := hivetest.Logger(t)
	go func() {
		time.Sleep(100 * time.Millisecond)
		writeFile(t, path, "nonMasqueradeCIDRs: [10.0.0.0/8]\nmasqLinkLocal: true\n")
	}()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := h.Start(log, ctx); err != nil {
		t.Fatal(err)
	}
	defer h.Stop(log, context.Background())
	if want := []netip.Prefix{netip.MustParsePrefix("10.0.0.0/8")}; !slices.Equal(got.cidrs, want) {
		t.Fatalf("foreign start hook read %v, want %v", got.cidrs, want)
	}
}

// Example_embedding shows a bigger agent embedding the config cell and
// reading the non-masquerade CIDRs from memory.
func Example_embedding() {
	dir, _ := os.MkdirTemp("", "ipmasq-example")
	defer os.RemoveAll(dir)
	path := filepath.Join(dir, "ip-masq-agent")
	os.WriteFile(path, []byte("nonMasqueradeCIDRs: [10.0.0.0/8, 172.16.0.0/12]\n"), 0o644)

	h := hive.New(
		statedb.Cell, job.Cell, cell.SimpleHealthCell, // what the cells need from the host hive
		settings.Cell, config.Cell, // ipmasq's config file and tables
		cell.Invoke(func(lc cell.Lifecycle, db *statedb.DB, tbl statedb.Table[*tables.NonMasqCIDR]) {
			lc.Append(cell.Hook{OnStart: func(ctx cell.HookContext) error {
				txn, err := tables.WaitForConfig(ctx, db, tbl)
				if err != nil {
					return err
				}
				fmt.Println("IPv4:", tables.NoMasqueradePrefixes(txn, tbl, tables.IPv4))
				fmt.Println("IPv6:", tables.NoMasqueradePrefixes(txn, tbl, tables.IPv6))
				dst := netip.MustParseAddr("172.16.3.4")
				fmt.Println("masquerade 172.16.3.4:", tables.ShouldMasquerade(txn, tbl, dst))
				return nil
			}})
		}),
	)
	hive.AddConfigOverride(h, func(c *config.Config) { c.IPMasqAgentConfigPath = path })
	hive.AddConfigOverride(h, func(c *settings.Config) { c.EnableIPv6 = true }) // --enable-ipv6
	log := slog.New(slog.DiscardHandler)
	if err := h.Start(log, context.Background()); err != nil {
		fmt.Println(err)
		return
	}
	h.Stop(log, context.Background())
	// Output:
	// IPv4: [10.0.0.0/8 169.254.0.0/16 172.16.0.0/12]
	// IPv6: [fe80::/10]
	// masquerade 172.16.3.4: false
}
