// Package config is the config cell: it reads the ip-masq-agent config
// file, validates it, and writes the result into the nonmasq-cidrs table
// (one row per destination prefix) and the one-row ipmasq-config status
// table. It is the only writer of both.
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
