package ipmasq_test

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"log/slog"
	"maps"
	"net"
	"net/netip"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/cilium/ebpf"
	"github.com/cilium/hive"
	"github.com/cilium/hive/hivetest"
	"github.com/cilium/hive/script"
	"github.com/cilium/hive/script/scripttest"
	"github.com/spf13/pflag"
	"github.com/vishvananda/netlink"
	"github.com/vishvananda/netns"
	"golang.org/x/sys/unix"

	"github.com/cilium/hive/cell"

	"github.com/ipmasq/ipmasq/agent"
	"github.com/ipmasq/ipmasq/bpf"
	"github.com/ipmasq/ipmasq/cells/ipam"
	"github.com/ipmasq/ipmasq/cmd/ipmasq-demo/topology"
	"github.com/ipmasq/ipmasq/ipamapi"
	"github.com/ipmasq/ipmasq/reconcilers/iprules"
	"github.com/ipmasq/ipmasq/tables"
	"github.com/ipmasq/ipmasq/testkit/faults"
	"github.com/ipmasq/ipmasq/testkit/iprulestest"
	"github.com/ipmasq/ipmasq/testkit/netnstest"
	"github.com/ipmasq/ipmasq/testkit/privtest"
)

var debug = flag.Bool("debug", false, "log the agent at debug level in script tests")

// TestScript runs testdata/*.txtar against a real agent hive with a private
// bpffs and config directory. A "#!" first line passes agent flags.
// A script that waits for what never comes fails after scriptTimeout (all
// of them together take well under a minute), not at the package's
// timeout: one stuck wait must not hold the whole suite.
func TestScript(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), scriptTimeout)
	// Cleanup, not defer: the scripts are parallel subtests, run after
	// this function returns.
	t.Cleanup(cancel)
	scripttest.Test(t, ctx, newEngine, nil, "testdata/*.txtar")
}

// scriptTimeout bounds TestScript: the scripts run in parallel.
const scriptTimeout = 10 * time.Minute

// agentUnderTest is the agent of one script. Commands reach the current
// hive through it, so "agent/restart" can replace the hive mid-script the
// way a restarted process would, keeping bpffs and config directory.
type agentUnderTest struct {
	t     testing.TB
	args  []string
	extra []cell.Cell
	// ns is the test's network namespace: the agent's devices and datapath live there.
	ns      netns.NsHandle
	h       *hive.Hive
	cmds    map[string]script.Cmd
	started bool
}

func (a *agentUnderTest) build(s *script.State) {
	// agent.New with the reconcilers' Operations decorated by the fault
	// injector, and the devices and datapath in the test's namespace.
	h := hive.NewWithOptions(agent.Options(),
		append([]cell.Cell{agent.Infrastructure, netnstest.Agent(a.ns, faults.Decorate(agent.Cell))}, a.extra...)...)
	flags := pflag.NewFlagSet("agent", pflag.ContinueOnError)
	h.RegisterFlags(flags)
	// The scripts cover both families; the agent's own default is IPv4
	// only (the Kubernetes agent's), so IPv6 is turned on here and a
	// script's "#!" line may turn it off again.
	// "#!" flags may name files of the script's own: $WORK is expanded.
	args := make([]string, len(a.args))
	for i, arg := range a.args {
		args[i] = os.Expand(arg, func(name string) string { v, _ := s.LookupEnv(name); return v })
	}
	if err := flags.Parse(append([]string{"--enable-ipv6=true"}, args...)); err != nil {
		a.t.Fatalf("agent flags %v: %v", a.args, err)
	}
	cmds, err := h.ScriptCommands(hivetest.Logger(a.t, hivetest.LogLevel(logLevel())))
	if err != nil {
		a.t.Fatalf("agent hive: %v", err)
	}
	a.h, a.cmds, a.started = h, cmds, false
}

func logLevel() slog.Level {
	if *debug {
		return slog.LevelDebug
	}
	return slog.LevelInfo
}

func (a *agentUnderTest) stop() error {
	if a.h == nil {
		return nil
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	return a.h.Stop(hivetest.Logger(a.t), ctx)
}

// agentCommandUsage lists the agent's script commands with their usage, from
// a hive that is built on throwaway directories and never started.
func agentCommandUsage(t testing.TB, bpfRoot string) map[string]*script.CmdUsage {
	dir := t.TempDir()
	h := agent.New(cell.Provide(func() iprules.Target { return iprulestest.NewMemoryTarget() }))
	flags := pflag.NewFlagSet("usage", pflag.ContinueOnError)
	h.RegisterFlags(flags)
	if err := flags.Parse([]string{
		"--bpf-root=" + bpfRoot,
		"--ip-masq-agent-config-path=" + filepath.Join(dir, "none"),
		"--state-dir=" + filepath.Join(dir, "state"),
		"--api-socket=" + filepath.Join(dir, "api.sock"),
		"--shell-sock-path=",
	}); err != nil {
		t.Fatal(err)
	}
	cmds, err := h.ScriptCommands(hivetest.Logger(t, hivetest.LogLevel(slog.LevelError)))
	if err != nil {
		t.Fatalf("agent hive: %v", err)
	}
	out := make(map[string]*script.CmdUsage, len(cmds))
	for name, cmd := range cmds {
		out[name] = cmd.Usage()
	}
	return out
}

// proxy forwards a command to the current hive's command of that name.
// The hive is built by the first agent command of the script, as a process
// would start: commands before it (config/write, state/seed, bpf/...) set up
// what the agent finds when it starts.
func (a *agentUnderTest) proxy(name string, usage *script.CmdUsage) script.Cmd {
	return script.Command(*usage, func(s *script.State, args ...string) (script.WaitFunc, error) {
		if a.h == nil {
			a.build(s)
		}
		cmd, ok := a.cmds[name]
		if !ok {
			return nil, fmt.Errorf("%s: not available in this hive", name)
		}
		return cmd.Run(s, args...)
	})
}

func newEngine(t testing.TB, args []string) *script.Engine {
	privtest.Require(t)
	dir := t.TempDir()
	bpfRoot := privtest.MountBPFFS(t)
	configPath := filepath.Join(dir, "config", "ip-masq-agent")

	apiSocket := filepath.Join(dir, "api.sock")
	// The agent's devices (and, with --rules-target=netns, its ip rules)
	// live in a network namespace made for this test: the datapath must
	// never see the host's devices.
	ns, nlh := privtest.NewNetns(t)
	args, target := rulesTarget(t, args, ns)
	// One injector for the whole script: a fault outlives agent/restart the
	// way a kernel condition would.
	inj := faults.New()
	a := &agentUnderTest{
		t: t,
		args: append([]string{
			"--bpf-root=" + bpfRoot,
			"--ip-masq-agent-config-path=" + configPath,
			"--state-dir=" + filepath.Join(dir, "state"),
			"--api-socket=" + apiSocket,
			"--shell-sock-path=" + filepath.Join(dir, "shell.sock"),
		}, args...),
		ns: ns,
		extra: []cell.Cell{
			cell.Provide(func() iprules.Target { return target }),
			cell.Provide(func() *faults.Injector { return inj }),
		},
	}
	t.Cleanup(func() {
		if err := a.stop(); err != nil {
			t.Errorf("stop agent: %v", err)
		}
	})

	cmds := scripttest.DefaultCmds()
	for name, usage := range agentCommandUsage(t, bpfRoot) {
		cmds[name] = a.proxy(name, usage)
	}
	maps.Copy(cmds, configCommands(configPath))
	maps.Copy(cmds, bpfCommands(filepath.Join(bpfRoot, "ipmasq")))
	maps.Copy(cmds, apiCommands(ipamapi.NewClient(apiSocket)))
	maps.Copy(cmds, stateCommands(filepath.Join(dir, "state")))
	maps.Copy(cmds, netnsCommands(nlh))
	maps.Copy(cmds, tunCommands(t, &topology.Netns{Name: "agent", Handle: ns, NL: nlh}))
	maps.Copy(cmds, faultCommands(inj))
	cmds["agent/restart"] = script.Command(
		script.CmdUsage{Summary: "Stop the agent and start a new one on the same bpffs and config, like a process restart"},
		func(s *script.State, _ ...string) (script.WaitFunc, error) {
			if err := a.stop(); err != nil {
				return nil, fmt.Errorf("stop: %w", err)
			}
			a.build(s)
			return a.cmds["hive/start"].Run(s)
		})
	return &script.Engine{
		Cmds:             cmds,
		Conds:            scripttest.DefaultConds(),
		RetryInterval:    10 * time.Millisecond,
		MaxRetryInterval: 100 * time.Millisecond,
	}
}

// configCommands change the agent's config file the ways operators and
// Kubernetes do.
func configCommands(path string) map[string]script.Cmd {
	dir := filepath.Dir(path)
	name := filepath.Base(path)
	return map[string]script.Cmd{
		"config/write": script.Command(
			script.CmdUsage{Summary: "Write a file from the archive into the config file in place (truncate and write)", Args: "file"},
			func(s *script.State, args ...string) (script.WaitFunc, error) {
				if len(args) != 1 {
					return nil, script.ErrUsage
				}
				data, err := os.ReadFile(s.Path(args[0]))
				if err != nil {
					return nil, err
				}
				if err := os.MkdirAll(dir, 0o755); err != nil {
					return nil, err
				}
				return nil, os.WriteFile(path, data, 0o644)
			}),
		"config/rename": script.Command(
			script.CmdUsage{Summary: "Replace the config file the way editors do: write a temporary file and rename it over", Args: "file"},
			func(s *script.State, args ...string) (script.WaitFunc, error) {
				if len(args) != 1 {
					return nil, script.ErrUsage
				}
				data, err := os.ReadFile(s.Path(args[0]))
				if err != nil {
					return nil, err
				}
				if err := os.MkdirAll(dir, 0o755); err != nil {
					return nil, err
				}
				tmp := filepath.Join(dir, "."+name+".swp")
				if err := os.WriteFile(tmp, data, 0o644); err != nil {
					return nil, err
				}
				return nil, os.Rename(tmp, path)
			}),
		"config/configmap": script.Command(
			script.CmdUsage{Summary: "Update the config the way the kubelet updates a ConfigMap volume (..data symlink swap)", Args: "file"},
			func(s *script.State, args ...string) (script.WaitFunc, error) {
				if len(args) != 1 {
					return nil, script.ErrUsage
				}
				data, err := os.ReadFile(s.Path(args[0]))
				if err != nil {
					return nil, err
				}
				return nil, configMapUpdate(dir, map[string][]byte{name: data})
			}),
		"config/projected": script.Command(
			script.CmdUsage{Summary: "Update a projected volume of several ConfigMaps the way the kubelet does (one ..data swap; files not named are removed)",
				Args: "name=file..."},
			func(s *script.State, args ...string) (script.WaitFunc, error) {
				files := map[string][]byte{}
				for _, a := range args {
					k, f, ok := strings.Cut(a, "=")
					if !ok {
						return nil, script.ErrUsage
					}
					data, err := os.ReadFile(s.Path(f))
					if err != nil {
						return nil, err
					}
					files[k] = data
				}
				return nil, configMapUpdate(dir, files)
			}),
		"config/dropin": script.Command(
			script.CmdUsage{Summary: "Write a file from the archive beside the config file, under a name (a drop-in when it starts with ip-masq)",
				Args: "name file"},
			func(s *script.State, args ...string) (script.WaitFunc, error) {
				if len(args) != 2 {
					return nil, script.ErrUsage
				}
				data, err := os.ReadFile(s.Path(args[1]))
				if err != nil {
					return nil, err
				}
				if err := os.MkdirAll(dir, 0o755); err != nil {
					return nil, err
				}
				tmp := filepath.Join(dir, "."+args[0]+".swp")
				if err := os.WriteFile(tmp, data, 0o644); err != nil {
					return nil, err
				}
				return nil, os.Rename(tmp, filepath.Join(dir, args[0]))
			}),
		"config/dropin-delete": script.Command(
			script.CmdUsage{Summary: "Delete a file beside the config file", Args: "name"},
			func(s *script.State, args ...string) (script.WaitFunc, error) {
				if len(args) != 1 {
					return nil, script.ErrUsage
				}
				return nil, os.Remove(filepath.Join(dir, args[0]))
			}),
		"config/delete": script.Command(
			script.CmdUsage{Summary: "Delete the config file"},
			func(s *script.State, args ...string) (script.WaitFunc, error) {
				return nil, os.Remove(path)
			}),
		"config/dir-in-place": script.Command(
			script.CmdUsage{Summary: "Create a directory where the config file should be"},
			func(s *script.State, args ...string) (script.WaitFunc, error) {
				return nil, os.MkdirAll(path, 0o755)
			}),
		"config/rmdir": script.Command(
			script.CmdUsage{Summary: "Delete the config directory and everything in it"},
			func(s *script.State, args ...string) (script.WaitFunc, error) {
				return nil, os.RemoveAll(dir)
			}),
	}
}

// configMapUpdate does what the kubelet's atomic writer does: write the new
// content (files by name) into a fresh timestamped directory, point ..data
// at it with a rename, make each file a symlink through ..data, and remove
// the links of files the new content no longer has.
func configMapUpdate(dir string, files map[string][]byte) error {
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return err
	}
	ts := filepath.Join(dir, "..ts_"+strconv.FormatInt(time.Now().UnixNano(), 10))
	if err := os.Mkdir(ts, 0o755); err != nil {
		return err
	}
	for name, data := range files {
		if err := os.WriteFile(filepath.Join(ts, name), data, 0o644); err != nil {
			return err
		}
	}
	old, _ := os.Readlink(filepath.Join(dir, "..data"))
	tmpLink := filepath.Join(dir, "..data_tmp")
	if err := os.Symlink(filepath.Base(ts), tmpLink); err != nil {
		return err
	}
	if err := os.Rename(tmpLink, filepath.Join(dir, "..data")); err != nil {
		return err
	}
	for name := range files {
		userLink := filepath.Join(dir, name)
		if target, err := os.Readlink(userLink); err != nil || target != filepath.Join("..data", name) {
			os.Remove(userLink)
			if err := os.Symlink(filepath.Join("..data", name), userLink); err != nil {
				return err
			}
		}
	}
	if old != "" {
		// The links of the old content's files that are gone.
		des, err := os.ReadDir(filepath.Join(dir, old))
		if err != nil {
			return err
		}
		for _, de := range des {
			if _, ok := files[de.Name()]; !ok {
				if err := os.Remove(filepath.Join(dir, de.Name())); err != nil {
					return err
				}
			}
		}
		return os.RemoveAll(filepath.Join(dir, old))
	}
	return nil
}

// bpfCommands change pinned maps behind the agent's back, to test drift
// repair and incompatible pins.
func bpfCommands(pinDir string) map[string]script.Cmd {
	return map[string]script.Cmd{
		"bpf/put": script.Command(
			script.CmdUsage{Summary: "Write an entry into a pinned nonmasq map directly", Args: "map prefix action-value"},
			func(s *script.State, args ...string) (script.WaitFunc, error) {
				if len(args) != 3 {
					return nil, script.ErrUsage
				}
				m, err := ebpf.LoadPinnedMap(filepath.Join(pinDir, args[0]), nil)
				if err != nil {
					return nil, err
				}
				defer m.Close()
				prefix, err := netip.ParsePrefix(args[1])
				if err != nil {
					return nil, err
				}
				v, err := strconv.ParseUint(args[2], 10, 8)
				if err != nil {
					return nil, err
				}
				if prefix.Addr().Is4() {
					return nil, m.Put(bpf.LPMKeyV4From(prefix), uint8(v))
				}
				return nil, m.Put(bpf.LPMKeyV6From(prefix), uint8(v))
			}),
		"exists-pin": script.Command(
			script.CmdUsage{Summary: "Succeed if a map is pinned under <bpf-root>/ipmasq", Args: "map"},
			func(s *script.State, args ...string) (script.WaitFunc, error) {
				if len(args) != 1 {
					return nil, script.ErrUsage
				}
				_, err := os.Stat(filepath.Join(pinDir, args[0]))
				return nil, err
			}),
		"bpf/links": script.Command(
			script.CmdUsage{Summary: "List the pinned tc links (ifindex-hook), like ls <bpf-root>/ipmasq/links"},
			func(s *script.State, args ...string) (script.WaitFunc, error) {
				entries, err := os.ReadDir(filepath.Join(pinDir, "links"))
				if err != nil && !os.IsNotExist(err) {
					return nil, err
				}
				var b strings.Builder
				for _, e := range entries {
					b.WriteString(e.Name() + "\n")
				}
				return func(*script.State) (string, string, error) { return b.String(), "", nil }, nil
			}),
		"bpf/pin-incompatible": script.Command(
			script.CmdUsage{Summary: "Pin a map with the wrong layout (a hash map) at a nonmasq map's path", Args: "map"},
			func(s *script.State, args ...string) (script.WaitFunc, error) {
				if len(args) != 1 {
					return nil, script.ErrUsage
				}
				if err := os.MkdirAll(pinDir, 0o700); err != nil {
					return nil, err
				}
				m, err := ebpf.NewMap(&ebpf.MapSpec{Type: ebpf.Hash, KeySize: 8, ValueSize: 4, MaxEntries: 16})
				if err != nil {
					return nil, err
				}
				defer m.Close()
				return nil, m.Pin(filepath.Join(pinDir, args[0]))
			}),
	}
}

// rulesTarget picks where the agent's ip rules go, from the test-only
// "--rules-target=memory|netns" script argument (default memory): an
// in-memory target, or the kernel inside a network namespace made for this
// test only, written the way the agent writes it (pipelined batches).
func rulesTarget(t testing.TB, args []string, ns netns.NsHandle) ([]string, iprules.Target) {
	kind := "memory"
	var rest []string
	for _, a := range args {
		if v, ok := strings.CutPrefix(a, "--rules-target="); ok {
			kind = v
			continue
		}
		rest = append(rest, a)
	}
	switch kind {
	case "memory":
		return rest, iprulestest.NewMemoryTarget()
	case "netns":
		target, err := iprules.NewNetlinkTargetAt(ns)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { target.Close() })
		return rest, target
	}
	t.Fatalf("--rules-target=%s: want memory or netns", kind)
	return nil, nil
}

// tunCommands add L3 devices (no link-layer header) to the test's network
// namespace, and send from it; the devices go away when the test ends.
func tunCommands(t testing.TB, n *topology.Netns) map[string]script.Cmd {
	return map[string]script.Cmd{
		"netns/udp-send": script.Command(
			script.CmdUsage{Summary: "Send one UDP datagram from the test netns (through its routes and devices)", Args: "addr:port"},
			func(s *script.State, args ...string) (script.WaitFunc, error) {
				if len(args) != 1 {
					return nil, script.ErrUsage
				}
				return nil, n.Do(func() error {
					c, err := net.Dial("udp", args[0])
					if err != nil {
						return err
					}
					defer c.Close()
					_, err = c.Write([]byte("ipmasq"))
					return err
				})
			}),
		"netns/tun-uplink": script.Command(
			script.CmdUsage{Summary: "Give the test netns an L3 uplink: tun device <name>, up, with the address and a default route through it", Args: "name cidr"},
			func(s *script.State, args ...string) (script.WaitFunc, error) {
				if len(args) != 2 {
					return nil, script.ErrUsage
				}
				f, err := topology.OpenTun(n, args[0])
				if err != nil {
					return nil, err
				}
				t.Cleanup(func() { f.Close() })
				l, err := n.NL.LinkByName(args[0])
				if err != nil {
					return nil, err
				}
				if err := n.NL.LinkSetUp(l); err != nil {
					return nil, err
				}
				if err := n.Addr(args[0], args[1]); err != nil {
					return nil, err
				}
				return nil, n.NL.RouteAdd(&netlink.Route{LinkIndex: l.Attrs().Index, Dst: &net.IPNet{IP: net.IPv4zero, Mask: net.CIDRMask(0, 32)}})
			}),
	}
}

// addrCommand is a "device cidr" command that adds or removes (op) an
// address of a device in the test's network namespace.
func addrCommand(h *netlink.Handle, summary string, op func(netlink.Link, *netlink.Addr) error) script.Cmd {
	return script.Command(
		script.CmdUsage{Summary: summary, Args: "device cidr"},
		func(s *script.State, args ...string) (script.WaitFunc, error) {
			if len(args) != 2 {
				return nil, script.ErrUsage
			}
			prefix, err := netip.ParsePrefix(args[1])
			if err != nil {
				return nil, err
			}
			l, err := h.LinkByName(args[0])
			if err != nil {
				return nil, err
			}
			ipnet := &net.IPNet{IP: prefix.Addr().AsSlice(), Mask: net.CIDRMask(prefix.Bits(), prefix.Addr().BitLen())}
			return nil, op(l, &netlink.Addr{IPNet: ipnet})
		})
}

// netnsCommands set up and query routing in the test's network namespace.
func netnsCommands(h *netlink.Handle) map[string]script.Cmd {
	return map[string]script.Cmd{
		"netns/endpoint": script.Command(
			script.CmdUsage{
				Summary: "Give the test netns an endpoint: veth pod0 with the address and a default route in the table, veth up0 as the main table's default",
				Args:    "ip table",
			},
			func(s *script.State, args ...string) (script.WaitFunc, error) {
				if len(args) != 2 {
					return nil, script.ErrUsage
				}
				ip, err := netip.ParseAddr(args[0])
				if err != nil {
					return nil, err
				}
				table, err := strconv.Atoi(args[1])
				if err != nil {
					return nil, err
				}
				return nil, setupEndpointRouting(h, ip, table)
			}),
		"netns/uplink": script.Command(
			script.CmdUsage{Summary: "Give the test netns an uplink: veth <name> (peer <name>-peer) with the address and a default route via gw (- for none: the connected subnet is its only route)", Args: "name cidr gw|-"},
			func(s *script.State, args ...string) (script.WaitFunc, error) {
				if len(args) != 3 {
					return nil, script.ErrUsage
				}
				return nil, setupUplink(h, args[0], args[1], args[2])
			}),
		"netns/addr":     addrCommand(h, "Add an address to a device in the test netns", h.AddrAdd),
		"netns/addr-del": addrCommand(h, "Remove an address from a device in the test netns", h.AddrDel),
		"netns/del-routes": script.Command(
			script.CmdUsage{Summary: "Delete every main-table route through a device in the test netns (default and connected): nothing is forwarded through it", Args: "device"},
			func(s *script.State, args ...string) (script.WaitFunc, error) {
				if len(args) != 1 {
					return nil, script.ErrUsage
				}
				l, err := h.LinkByName(args[0])
				if err != nil {
					return nil, err
				}
				routes, err := h.RouteListFiltered(netlink.FAMILY_ALL, &netlink.Route{LinkIndex: l.Attrs().Index, Table: unix.RT_TABLE_MAIN},
					netlink.RT_FILTER_OIF|netlink.RT_FILTER_TABLE)
				if err != nil {
					return nil, err
				}
				for _, r := range routes {
					if err := h.RouteDel(&r); err != nil {
						return nil, fmt.Errorf("delete route %s: %w", r, err)
					}
				}
				return nil, nil
			}),
		"route/get": script.Command(
			script.CmdUsage{Summary: "Look up the route the kernel picks for dst from src (like ip route get dst from src)", Args: "dst src"},
			func(s *script.State, args ...string) (script.WaitFunc, error) {
				if len(args) != 2 {
					return nil, script.ErrUsage
				}
				dst, src := net.ParseIP(args[0]), net.ParseIP(args[1])
				if dst == nil || src == nil {
					return nil, fmt.Errorf("bad address in %v", args)
				}
				routes, err := h.RouteGetWithOptions(dst, &netlink.RouteGetOptions{SrcAddr: src})
				if err != nil {
					return nil, err
				}
				var b strings.Builder
				for _, r := range routes {
					link, err := h.LinkByIndex(r.LinkIndex)
					if err != nil {
						return nil, err
					}
					fmt.Fprintf(&b, "%s dev %s table %s\n", dst, link.Attrs().Name, iprulesTableName(r.Table))
				}
				return func(*script.State) (string, string, error) { return b.String(), "", nil }, nil
			}),
	}
}

func iprulesTableName(t int) string {
	if t == 254 {
		return "main"
	}
	return strconv.Itoa(t)
}

func setupUplink(h *netlink.Handle, name, cidr, gw string) error {
	prefix, err := netip.ParsePrefix(cidr)
	if err != nil {
		return err
	}
	var gwAddr netip.Addr
	if gw != "-" {
		if gwAddr, err = netip.ParseAddr(gw); err != nil {
			return err
		}
	}
	if err := h.LinkAdd(&netlink.Veth{LinkAttrs: netlink.LinkAttrs{Name: name}, PeerName: name + "-peer"}); err != nil {
		return fmt.Errorf("add veth %s: %w", name, err)
	}
	for _, n := range []string{name, name + "-peer"} {
		l, err := h.LinkByName(n)
		if err != nil {
			return err
		}
		if err := h.LinkSetUp(l); err != nil {
			return err
		}
	}
	l, _ := h.LinkByName(name)
	addr := &netlink.Addr{IPNet: &net.IPNet{IP: prefix.Addr().AsSlice(), Mask: net.CIDRMask(prefix.Bits(), prefix.Addr().BitLen())}}
	if err := h.AddrAdd(l, addr); err != nil {
		return err
	}
	if !gwAddr.IsValid() {
		return nil // its connected subnet is its only route
	}
	return h.RouteAdd(&netlink.Route{LinkIndex: l.Attrs().Index, Gw: gwAddr.AsSlice()})
}

func setupEndpointRouting(h *netlink.Handle, ip netip.Addr, table int) error {
	veth := &netlink.Veth{LinkAttrs: netlink.LinkAttrs{Name: "pod0"}, PeerName: "up0"}
	if err := h.LinkAdd(veth); err != nil {
		return fmt.Errorf("add veth: %w", err)
	}
	for _, name := range []string{"pod0", "up0"} {
		l, err := h.LinkByName(name)
		if err != nil {
			return err
		}
		if err := h.LinkSetUp(l); err != nil {
			return err
		}
	}
	pod, _ := h.LinkByName("pod0")
	up, _ := h.LinkByName("up0")
	bits := ip.BitLen()
	if err := h.AddrAdd(pod, &netlink.Addr{IPNet: &net.IPNet{IP: ip.AsSlice(), Mask: net.CIDRMask(bits, bits)}}); err != nil {
		return fmt.Errorf("add address: %w", err)
	}
	any := &net.IPNet{IP: net.IPv4zero, Mask: net.CIDRMask(0, 32)}
	if ip.Is6() {
		any = &net.IPNet{IP: net.IPv6zero, Mask: net.CIDRMask(0, 128)}
	}
	if err := h.RouteAdd(&netlink.Route{LinkIndex: pod.Attrs().Index, Dst: any, Table: table, Scope: netlink.SCOPE_LINK}); err != nil {
		return fmt.Errorf("add route table %d: %w", table, err)
	}
	if err := h.RouteAdd(&netlink.Route{LinkIndex: up.Attrs().Index, Dst: any, Scope: netlink.SCOPE_LINK}); err != nil {
		return fmt.Errorf("add main route: %w", err)
	}
	return nil
}

// apiCommands drive the agent's API over its socket.
func apiCommands(c *ipamapi.Client) map[string]script.Cmd {
	return map[string]script.Cmd{
		"api/allocate": script.Command(
			script.CmdUsage{Summary: "Allocate an address over the API and print the answer", Args: "owner family [route-table]"},
			func(s *script.State, args ...string) (script.WaitFunc, error) {
				if len(args) < 2 || len(args) > 3 {
					return nil, script.ErrUsage
				}
				req := ipamapi.AllocationRequest{Owner: args[0], Family: args[1]}
				if len(args) == 3 {
					n, err := strconv.ParseUint(args[2], 10, 32)
					if err != nil {
						return nil, err
					}
					rt := uint32(n)
					req.RouteTable = &rt
				}
				resp, err := c.Allocate(s.Context(), req)
				if err != nil {
					return nil, err
				}
				out, _ := json.Marshal(resp)
				return func(*script.State) (string, string, error) { return string(out) + "\n", "", nil }, nil
			}),
		"api/release": script.Command(
			script.CmdUsage{Summary: "Release an address over the API", Args: "ip"},
			func(s *script.State, args ...string) (script.WaitFunc, error) {
				if len(args) != 1 {
					return nil, script.ErrUsage
				}
				ip, err := netip.ParseAddr(args[0])
				if err != nil {
					return nil, err
				}
				return nil, c.Release(s.Context(), ip)
			}),
		"api/list": script.Command(
			script.CmdUsage{Summary: "List allocations over the API"},
			func(s *script.State, args ...string) (script.WaitFunc, error) {
				list, err := c.List(s.Context())
				if err != nil {
					return nil, err
				}
				var b strings.Builder
				for _, a := range list {
					fmt.Fprintf(&b, "%s %s %d\n", a.IP, a.Owner, a.RouteTable)
				}
				return func(*script.State) (string, string, error) { return b.String(), "", nil }, nil
			}),
	}
}

// stateCommands change the IPAM state directory behind the agent's back.
func stateCommands(dir string) map[string]script.Cmd {
	return map[string]script.Cmd{
		"state/write": script.Command(
			script.CmdUsage{Summary: "Write a file from the archive into the state directory", Args: "src name"},
			func(s *script.State, args ...string) (script.WaitFunc, error) {
				if len(args) != 2 {
					return nil, script.ErrUsage
				}
				data, err := os.ReadFile(s.Path(args[0]))
				if err != nil {
					return nil, err
				}
				if err := os.MkdirAll(dir, 0o700); err != nil {
					return nil, err
				}
				return nil, os.WriteFile(filepath.Join(dir, args[1]), data, 0o600)
			}),
		"state/seed": script.Command(
			script.CmdUsage{Summary: "Write a valid endpoints state file with these endpoints (restored at the next agent start)", Args: "ip owner table ..."},
			func(s *script.State, args ...string) (script.WaitFunc, error) {
				if len(args) == 0 || len(args)%3 != 0 {
					return nil, script.ErrUsage
				}
				var eps []*tables.Endpoint
				for i := 0; i < len(args); i += 3 {
					ip, err := netip.ParseAddr(args[i])
					if err != nil {
						return nil, err
					}
					rt, err := strconv.ParseUint(args[i+2], 10, 32)
					if err != nil {
						return nil, err
					}
					eps = append(eps, &tables.Endpoint{IP: ip, Owner: args[i+1], RouteTable: uint32(rt), Created: time.Unix(0, 0).UTC()})
				}
				store, err := ipam.NewStore(dir)
				if err != nil {
					return nil, err
				}
				return nil, store.Save(eps)
			}),
		"state/ls": script.Command(
			script.CmdUsage{Summary: "List the state directory"},
			func(s *script.State, args ...string) (script.WaitFunc, error) {
				entries, err := os.ReadDir(dir)
				if err != nil {
					return nil, err
				}
				var b strings.Builder
				for _, e := range entries {
					b.WriteString(e.Name() + "\n")
				}
				return func(*script.State) (string, string, error) { return b.String(), "", nil }, nil
			}),
	}
}

// faultCommands make the agent's kernel writes fail at a fault point (see
// faults.Points) and clear the fault again.
func faultCommands(inj *faults.Injector) map[string]script.Cmd {
	point := func(name string) error {
		if !slices.Contains(faults.Points, name) {
			return fmt.Errorf("fault point %q: want one of %s", name, strings.Join(faults.Points, ", "))
		}
		return nil
	}
	return map[string]script.Cmd{
		"faults/fail": script.Command(
			script.CmdUsage{
				Summary: "Fail every kernel write at a fault point with the message (default: injected fault) until faults/clear",
				Args:    "point [message]",
			},
			func(s *script.State, args ...string) (script.WaitFunc, error) {
				if len(args) < 1 || len(args) > 2 {
					return nil, script.ErrUsage
				}
				if err := point(args[0]); err != nil {
					return nil, err
				}
				var err error
				if len(args) == 2 {
					err = errors.New(args[1])
				}
				inj.Fail(args[0], err)
				return nil, nil
			}),
		"faults/clear": script.Command(
			script.CmdUsage{Summary: "Let the kernel writes at a fault point through again", Args: "point"},
			func(s *script.State, args ...string) (script.WaitFunc, error) {
				if len(args) != 1 {
					return nil, script.ErrUsage
				}
				if err := point(args[0]); err != nil {
					return nil, err
				}
				inj.Clear(args[0])
				return nil, nil
			}),
		"faults/count": script.Command(
			script.CmdUsage{Summary: "Print how many operations a fault point has failed so far", Args: "point"},
			func(s *script.State, args ...string) (script.WaitFunc, error) {
				if len(args) != 1 {
					return nil, script.ErrUsage
				}
				if err := point(args[0]); err != nil {
					return nil, err
				}
				out := fmt.Sprintf("%d\n", inj.Injected(args[0]))
				return func(*script.State) (string, string, error) { return out, "", nil }, nil
			}),
	}
}
