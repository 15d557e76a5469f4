// Package config is the config cell: it reads the ip-masq-agent config
// file, validates it, and writes the result into the nonmasq-cidrs table
// (one row per destination prefix) and the one-row ipmasq-config status
// table. It is the only writer of both.
//
// Files named ip-masq* beside the config file (Azure's ip-masq-agent-v2
// reads every such file of its folder: several ConfigMaps projected into
// one volume) are read, watched and merged with it (merge.go); a bad one
// is named while the others stay applied. A key the format does not know
// is ignored, as the Kubernetes agent ignores it, and is a warning in the
// status table, with the known key nearest to it.
//
// The file's directory is watched with fsnotify so that plain writes,
// editors' rename dance, deletion and the Kubernetes ConfigMap symlink swap
// are applied within milliseconds. A file that fails validation changes
// nothing: the tables, and therefore the BPF maps and ip rules derived from
// them, keep the last good state while the error is shown in health, the log
// and the status table.
//
// The nonmasq-cidrs table is marked initialized only after the first
// successful load (or the decision that there is no file), so readers such
// as IPAM wait for it with tables.WaitForConfig instead of depending on the
// order in which cells start.
package config
