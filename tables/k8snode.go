package tables

import (
	"github.com/cilium/statedb"
	"github.com/cilium/statedb/index"
)

// KubernetesNodeTableName is the name of the table that tells whether the
// agent can read its own Node.
const KubernetesNodeTableName = "k8s-node"

// NodeReadState says how the last read of the agent's Node went.
type NodeReadState string

const (
	// NodeReading: the Node has not been read since the agent started.
	NodeReading NodeReadState = "reading"
	// NodeRead: the Node was read, and the watch on it runs.
	NodeRead NodeReadState = "read"
	// NodeNotFound: the API server answered, and has no Node of that name.
	NodeNotFound NodeReadState = "not-found"
	// NodeReadFailed: the last list or watch of the Node failed
	// (unreachable, forbidden, ...); Error says why.
	NodeReadFailed NodeReadState = "failed"
)

// KubernetesNode is the agent's view of its own Node: one row while the
// agent follows a Node (--k8s-node-name), none otherwise. The IPAM's pools
// come from the Node, so an agent that cannot read it is not ready
// (readers/readiness).
type KubernetesNode struct {
	// Name of the Node.
	Name string `json:"name" yaml:"name"`
	// State of the last read.
	State NodeReadState `json:"state" yaml:"state"`
	// Error is why the last read failed; empty otherwise.
	Error string `json:"error,omitempty" yaml:"error,omitempty"`
}

// Readable reports whether the Node was read and is being watched.
func (n *KubernetesNode) Readable() bool { return n.State == NodeRead }

// TableHeader implements statedb.TableWritable.
func (n *KubernetesNode) TableHeader() []string { return []string{"Name", "State", "Error"} }

// TableRow implements statedb.TableWritable.
func (n *KubernetesNode) TableRow() []string { return []string{n.Name, string(n.State), n.Error} }

// KubernetesNodeByName is the primary index of the k8s-node table.
var KubernetesNodeByName = statedb.Index[*KubernetesNode, string]{
	Name: "name",
	FromObject: func(n *KubernetesNode) index.KeySet {
		return index.NewKeySet(index.String(n.Name))
	},
	FromKey:    index.String,
	FromString: index.FromString,
	Unique:     true,
}

// NewKubernetesNodeTable creates the k8s-node table.
func NewKubernetesNodeTable(db *statedb.DB) (statedb.RWTable[*KubernetesNode], error) {
	return statedb.NewTable(db, KubernetesNodeTableName, KubernetesNodeByName)
}
