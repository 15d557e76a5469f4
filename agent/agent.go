// Package agent composes the ipmasq cells into the agent hive. A bigger
// agent embeds Cell (or a subset of the cells it groups) in its own hive
// next to its own Infrastructure.
package agent

import (
	"time"

	"github.com/cilium/hive"
	"github.com/cilium/hive/cell"
	"github.com/cilium/hive/job"
	"github.com/cilium/statedb"

	"github.com/ipmasq/ipmasq/cells/api"
	"github.com/ipmasq/ipmasq/cells/config"
	"github.com/ipmasq/ipmasq/cells/datapathtables"
	"github.com/ipmasq/ipmasq/cells/devices"
	"github.com/ipmasq/ipmasq/cells/egressrules"
	"github.com/ipmasq/ipmasq/cells/ipam"
	"github.com/ipmasq/ipmasq/cells/k8snode"
	"github.com/ipmasq/ipmasq/cells/netfilter"
	"github.com/ipmasq/ipmasq/cells/podcidrs"
	"github.com/ipmasq/ipmasq/internal/kubeclient"
	"github.com/ipmasq/ipmasq/readers/metrics"
	"github.com/ipmasq/ipmasq/readers/natview"
	"github.com/ipmasq/ipmasq/readers/nodeevents"
	"github.com/ipmasq/ipmasq/readers/readiness"
	"github.com/ipmasq/ipmasq/readers/shell"
	"github.com/ipmasq/ipmasq/readers/status"
	"github.com/ipmasq/ipmasq/reconcilers/datapath"
	"github.com/ipmasq/ipmasq/reconcilers/handover"
	"github.com/ipmasq/ipmasq/reconcilers/iprules"
	"github.com/ipmasq/ipmasq/reconcilers/masqrules"
	"github.com/ipmasq/ipmasq/reconcilers/masqsources"
	"github.com/ipmasq/ipmasq/reconcilers/natgc"
	"github.com/ipmasq/ipmasq/reconcilers/nodeaddrs"
	"github.com/ipmasq/ipmasq/reconcilers/nonmasqmaps"
	"github.com/ipmasq/ipmasq/reconcilers/tcattach"
	"github.com/ipmasq/ipmasq/settings"
)

// DefaultShellSock is where the agent's shell listens unless
// --shell-sock-path says otherwise.
const DefaultShellSock = shell.DefaultSocket

// EnvPrefix is the prefix of the environment variables that set flags:
// --ip-masq-agent-config-path can be given as IPMASQ_IP_MASQ_AGENT_CONFIG_PATH.
const EnvPrefix = "IPMASQ_"

// Infrastructure is what the ipmasq cells expect from their host hive: the
// StateDB, the job registry, health reporting and the "health" script
// command.
var Infrastructure = cell.Group(
	statedb.Cell,
	job.Cell,
	cell.SimpleHealthCell,
	cell.Provide(func(h *cell.SimpleHealth) hive.ScriptCmdOut {
		return hive.NewScriptCmd("health", metrics.HealthCmd(h))
	}),
)

// Cell is every ipmasq cell: settings, the Kubernetes connection, config
// file, pod CIDRs (flags and Node), BPF maps, devices and the eBPF
// datapath, IPAM and its API, the per-endpoint ip rules, the netfilter
// NAT rules that would decide first, and the readers
// (metrics, status, the Node's Events). Their order does not matter: each
// reads tables or pinned maps, never another cell's state filled at start;
// the one preference is nonmasqmaps after the datapath, whose loaded tries
// it writes (before, its first writes would fail and be retried).
var Cell = cell.Group(
	// First: no other start hook runs while another agent holds the state.
	stateLock,
	settings.Cell,
	// The API server connection (disabled without --k8s-node-name).
	kubeclient.Cell,
	config.Cell,
	metrics.Cell,
	// The pod CIDRs from the flags and from the Node.
	podcidrs.Cell,
	k8snode.Cell,
	devices.Cell,
	datapathtables.Cell,
	Datapath,
	// After the datapath, whose loader owns the nonmasq tries: they are
	// loaded before its reconciler's jobs start.
	nonmasqmaps.Cell,
	ipam.Cell,
	api.Cell,
	egressrules.Cell,
	iprules.Cell,
	// Netfilter NAT rules that decide before the datapath (read-only).
	netfilter.Cell,
	status.Cell,
	// Whether the node can do its job: /readyz and the health scope
	// "readiness".
	readiness.Cell,
	// datapath/nat: the NAT pairs, read from the pins.
	natview.Cell,
	// Config rejections as Events on the Node (with --k8s-node-name).
	nodeevents.Cell,
	// The live shell, read-only: the db/* queries and the cells' own
	// read commands (maps/dump, datapath/nat, config/status, ...); no exec,
	// no file access, no table writes.
	shell.Cell,
)

// Datapath is the eBPF masquerade datapath, one module (its health scope,
// flags and metrics label "datapath"): the loader first, whose start hook
// loads the programs before the jobs of the reconcilers after it start, then
// one reconciler per kernel object the programs are given.
var Datapath = cell.Module(
	"datapath",
	"eBPF masquerade datapath",

	datapath.Cell,
	tcattach.Cell,
	masqrules.Cell,
	masqsources.Cell,
	nodeaddrs.Cell,
	natgc.Cell,
	handover.Cell,
)

// Options are the hive options of the agent: flags from IPMASQ_* variables
// and a health scope per module.
func Options() hive.Options {
	opts := hive.DefaultOptions()
	opts.EnvPrefix = EnvPrefix
	// Log start/stop hooks only when slow; otherwise they are debug noise.
	opts.LogThreshold = 100 * time.Millisecond
	opts.ModuleDecorators = cell.ModuleDecorators{
		func(h cell.Health, id cell.ModuleID) cell.Health { return h.NewScope(string(id)) },
	}
	return opts
}

// New returns the agent hive.
func New(extra ...cell.Cell) *hive.Hive {
	return hive.NewWithOptions(Options(), append([]cell.Cell{Infrastructure, Cell}, extra...)...)
}
