// Package masqrules writes table masquerade-rule-sources (the config's
// masquerade rules, per device and source prefix) into the datapath's maps
// masq_rules_v4/v6. It is built like reconcilers/nodeaddrs.
package masqrules
