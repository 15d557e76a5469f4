package devices_test

import (
	"context"
	"fmt"
	"maps"
	"net"
	"testing"
	"time"

	"github.com/cilium/hive"
	"github.com/cilium/hive/cell"
	"github.com/cilium/hive/hivetest"
	"github.com/cilium/hive/job"
	"github.com/cilium/hive/script"
	"github.com/cilium/hive/script/scripttest"
	"github.com/cilium/statedb"
	"github.com/spf13/pflag"
	"github.com/vishvananda/netlink"

	"github.com/ipmasq/ipmasq/cells/devices"
	"github.com/ipmasq/ipmasq/tables"
	"github.com/ipmasq/ipmasq/testkit/netnstest"
)

// TestScript runs testdata/*.txtar: each script gets a devices cell
// watching a network namespace of its own, and commands that change the
// devices in it. A "#!" first line passes flags.
func TestScript(t *testing.T) {
	scripttest.Test(t, context.Background(), newEngine, nil, "testdata/*.txtar")
}

func newEngine(t testing.TB, args []string) *script.Engine {
	ns, nl := newNetns(t.(*testing.T))
	h := hive.New(statedb.Cell, job.Cell, cell.SimpleHealthCell, devices.Cell, netnstest.Devices(ns),
		// The pod CIDRs the agent knows (db/insert pod-cidrs): they tell
		// the pods' gateways from the uplinks.
		cell.Provide(tables.NewPodCIDRTable, statedb.RWTable[*tables.PodCIDR].ToTable))
	flags := pflag.NewFlagSet("test", pflag.ContinueOnError)
	h.RegisterFlags(flags)
	if err := flags.Parse(args); err != nil {
		t.Fatalf("flags %v: %v", args, err)
	}
	log := hivetest.Logger(t)
	cmds, err := h.ScriptCommands(log)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), waitTimeout)
		defer cancel()
		h.Stop(log, ctx)
	})
	all := scripttest.DefaultCmds()
	maps.Copy(all, cmds)
	maps.Copy(all, netnsCommands(nl))
	return &script.Engine{
		Cmds:             all,
		Conds:            scripttest.DefaultConds(),
		RetryInterval:    10 * time.Millisecond,
		MaxRetryInterval: 100 * time.Millisecond,
	}
}

// netnsCommands change the devices of the script's namespace the way ip(8)
// would.
func netnsCommands(nl *netlink.Handle) map[string]script.Cmd {
	link := func(name string) (netlink.Link, error) {
		l, err := nl.LinkByName(name)
		if err != nil {
			return nil, fmt.Errorf("link %s: %w", name, err)
		}
		return l, nil
	}
	addrCmd := func(summary string, op func(netlink.Link, *netlink.Addr) error) script.Cmd {
		return script.Command(script.CmdUsage{Summary: summary, Args: "device cidr"},
			func(s *script.State, args ...string) (script.WaitFunc, error) {
				if len(args) != 2 {
					return nil, script.ErrUsage
				}
				l, err := link(args[0])
				if err != nil {
					return nil, err
				}
				a, err := netlink.ParseAddr(args[1])
				if err != nil {
					return nil, err
				}
				a.Flags = 0x2 // IFA_F_NODAD: an IPv6 address is usable at once
				return nil, op(l, a)
			})
	}
	routeCmd := func(summary string, op func(*netlink.Route) error) script.Cmd {
		return script.Command(script.CmdUsage{Summary: summary, Args: "device gateway"},
			func(s *script.State, args ...string) (script.WaitFunc, error) {
				if len(args) != 2 {
					return nil, script.ErrUsage
				}
				l, err := link(args[0])
				if err != nil {
					return nil, err
				}
				gw := net.ParseIP(args[1])
				if gw == nil {
					return nil, fmt.Errorf("bad gateway %q", args[1])
				}
				return nil, op(&netlink.Route{LinkIndex: l.Attrs().Index, Gw: gw})
			})
	}
	// routeArgs parses "device destination [gateway]" ("default" for the
	// default route) into a main-table route.
	routeArgs := func(args []string) (*netlink.Route, error) {
		if len(args) != 2 && len(args) != 3 {
			return nil, script.ErrUsage
		}
		l, err := link(args[0])
		if err != nil {
			return nil, err
		}
		r := &netlink.Route{LinkIndex: l.Attrs().Index}
		if args[1] != "default" {
			if _, r.Dst, err = net.ParseCIDR(args[1]); err != nil {
				return nil, err
			}
		}
		if len(args) == 3 {
			if r.Gw = net.ParseIP(args[2]); r.Gw == nil {
				return nil, fmt.Errorf("bad gateway %q", args[2])
			}
		} else {
			r.Scope = netlink.SCOPE_LINK
		}
		return r, nil
	}
	routeCmd2 := func(summary string, op func(*netlink.Route) error) script.Cmd {
		return script.Command(script.CmdUsage{Summary: summary, Args: "device destination|default [gateway]"},
			func(s *script.State, args ...string) (script.WaitFunc, error) {
				r, err := routeArgs(args)
				if err != nil {
					return nil, err
				}
				return nil, op(r)
			})
	}
	return map[string]script.Cmd{
		"route/add": routeCmd2("Add a main-table route through a device (without gateway: scope link)", nl.RouteAdd),
		"route/del": routeCmd2("Delete a main-table route", nl.RouteDel),
		"link/add-veth": script.Command(
			script.CmdUsage{Summary: "Add an up veth pair, without IPv6 link-local addresses (so tables are stable)", Args: "name peer"},
			func(s *script.State, args ...string) (script.WaitFunc, error) {
				if len(args) != 2 {
					return nil, script.ErrUsage
				}
				if err := nl.LinkAdd(&netlink.Veth{LinkAttrs: netlink.LinkAttrs{Name: args[0]}, PeerName: args[1]}); err != nil {
					return nil, err
				}
				for _, name := range args {
					l, err := link(name)
					if err != nil {
						return nil, err
					}
					if err := nl.LinkSetIP6AddrGenMode(l, 1 /* IN6_ADDR_GEN_MODE_NONE */); err != nil {
						return nil, err
					}
					if err := nl.LinkSetUp(l); err != nil {
						return nil, err
					}
				}
				return nil, nil
			}),
		"link/del": script.Command(script.CmdUsage{Summary: "Delete a device", Args: "name"},
			func(s *script.State, args ...string) (script.WaitFunc, error) {
				if len(args) != 1 {
					return nil, script.ErrUsage
				}
				l, err := link(args[0])
				if err != nil {
					return nil, err
				}
				return nil, nl.LinkDel(l)
			}),
		"addr/add":          addrCmd("Add an address to a device", nl.AddrAdd),
		"addr/del":          addrCmd("Delete an address from a device", nl.AddrDel),
		"route/add-default": routeCmd("Add a main-table default route through a device", nl.RouteAdd),
		"route/del-default": routeCmd("Delete a main-table default route", nl.RouteDel),
	}
}
