package tables

import (
	"strconv"
	"strings"
	"time"

	"github.com/cilium/statedb"
	"github.com/cilium/statedb/index"
)

// ConfigStatusTableName is the name of the one-row table that tells how the
// last config file load went.
const ConfigStatusTableName = "ipmasq-config"

// ConfigOrigin says what the current masquerade config was built from (a
// row's "origin": "source" is a packet's source address in this tree).
type ConfigOrigin string

const (
	// ConfigOriginNone means no load has succeeded yet.
	ConfigOriginNone ConfigOrigin = "none"
	// ConfigOriginFile means the config file was loaded.
	ConfigOriginFile ConfigOrigin = "file"
	// ConfigOriginDefaults means the file is absent or empty, so the reserved
	// ranges are in use.
	ConfigOriginDefaults ConfigOrigin = "defaults"
)

// ConfigStatus is the state of the config file: what is applied and why a
// newer file may have been rejected.
type ConfigStatus struct {
	// Path of the config file.
	Path string `json:"path" yaml:"path"`
	// Origin of the applied config.
	Origin ConfigOrigin `json:"origin" yaml:"origin"`
	// Generation counts the loads that changed the applied config.
	Generation uint64 `json:"generation" yaml:"generation"`
	// LastError is why the newest file content was rejected; empty when
	// the newest content is the applied one.
	LastError string `json:"lastError,omitempty" yaml:"lastError,omitempty"`
	// LastGoodLoad is when a file (or its absence) was last accepted.
	LastGoodLoad time.Time `json:"lastGoodLoad" yaml:"lastGoodLoad"`
	// NoMasqV4 and NoMasqV6 count no-masquerade prefixes per family.
	NoMasqV4, NoMasqV6 int
	// MasqExceptions counts masqueradeCIDRs prefixes.
	MasqExceptions int
	// MasqueradeRules counts masqueradeRules entries.
	MasqueradeRules int
	// ResyncInterval is the drift-repair interval in effect.
	ResyncInterval time.Duration `json:"resyncInterval" yaml:"resyncInterval"`
	// Files are the files merged into the applied config when there are
	// several (Path and the ip-masq* files beside it, as Azure's
	// ip-masq-agent-v2 reads them); empty for the one file at Path.
	Files []string `json:"files,omitempty" yaml:"files,omitempty"`
	// Warnings are what the applied config ignored or resolved: unknown
	// keys, and conflicts between merged files. They do not make the
	// status unhealthy.
	Warnings []ConfigWarning `json:"warnings,omitempty" yaml:"warnings,omitempty"`
}

// ConfigWarningKind says what a ConfigWarning is about.
type ConfigWarningKind string

const (
	// ConfigWarningUnknownKey is a key the format does not know, ignored.
	ConfigWarningUnknownKey ConfigWarningKind = "unknown-key"
	// ConfigWarningConflict is two merged files that disagree, resolved.
	ConfigWarningConflict ConfigWarningKind = "conflict"
	// ConfigWarningOdd is content read as the Kubernetes agent reads it
	// that most likely does not say what its author meant: a repeated key
	// (the last value wins), a second YAML document (ignored), a value
	// taken differently from how it is written (resyncInterval not above
	// 0, cidrLimit 0), or a YAML flow mapping in a file that starts
	// like JSON.
	ConfigWarningOdd ConfigWarningKind = "odd"
)

// ConfigWarning is one thing an operator should fix in an applied config.
type ConfigWarning struct {
	Kind ConfigWarningKind `json:"kind" yaml:"kind"`
	// Message names the file, the key and the value, and what was done.
	Message string `json:"message" yaml:"message"`
}

// WarningMessages returns the messages of the warnings, in order.
func (s *ConfigStatus) WarningMessages() []string {
	out := make([]string, len(s.Warnings))
	for i, w := range s.Warnings {
		out[i] = w.Message
	}
	return out
}

// Healthy reports whether the newest config content is the applied one.
func (s *ConfigStatus) Healthy() bool { return s.LastError == "" }

// TableHeader implements statedb.TableWritable.
func (s *ConfigStatus) TableHeader() []string {
	return []string{"Path", "Origin", "Generation", "NoMasqV4", "NoMasqV6", "MasqExceptions", "Rules", "Resync", "LastError", "Files", "Warnings"}
}

// TableRow implements statedb.TableWritable.
func (s *ConfigStatus) TableRow() []string {
	return []string{
		s.Path, string(s.Origin), strconv.FormatUint(s.Generation, 10),
		strconv.Itoa(s.NoMasqV4), strconv.Itoa(s.NoMasqV6),
		strconv.Itoa(s.MasqExceptions), strconv.Itoa(s.MasqueradeRules),
		s.ResyncInterval.String(), s.LastError,
		strings.Join(s.Files, ", "), strings.Join(s.WarningMessages(), "; "),
	}
}

// ConfigStatusByPath is the primary index of the ipmasq-config table.
var ConfigStatusByPath = statedb.Index[*ConfigStatus, string]{
	Name: "path",
	FromObject: func(s *ConfigStatus) index.KeySet {
		return index.NewKeySet(index.String(s.Path))
	},
	FromKey:    index.String,
	FromString: index.FromString,
	Unique:     true,
}

// NewConfigStatusTable creates the ipmasq-config table.
func NewConfigStatusTable(db *statedb.DB) (statedb.RWTable[*ConfigStatus], error) {
	return statedb.NewTable(db, ConfigStatusTableName, ConfigStatusByPath)
}
