// Package metrics serves the agent's Prometheus metrics and its health on
// --prometheus-serve-addr (off by default):
//
//	ipmasq-agent --prometheus-serve-addr=:9963
//	curl http://127.0.0.1:9963/metrics          # ipmasq_*, go_* and process_* metrics
//	curl http://127.0.0.1:9963/healthz          # 200 "ok", or 503 and the degraded health scopes
//	curl http://127.0.0.1:9963/healthz?verbose  # ... and every scope that has a status
//
// Like the status page it only reads: the tables and the nonmasq-maps and
// datapath handles at scrape time (an idle agent does no work for its
// metrics), and the health of every module. Two things are recorded as they
// happen because a scrape would miss them: config loads and rejections (a
// job watching the ipmasq-config table), and the reconcilers' rounds,
// errors and operation durations (Cell provides the hive's
// reconciler.Metrics, which reconcilers pick up through
// reconciler.Params.DefaultMetrics).
//
// Every source is optional: a hive that embeds only some ipmasq cells gets
// the metrics of those cells.
//
// The metrics, a contract with dashboards and alerts (deploy/grafana,
// deploy/prometheus): add; rename only with a release of overlap and a
// line in docs/observability.md's rename table. TestMetricListsMatchTheRegistry
// holds this list and docs/observability.md against what the cell registers.
//
//	ipmasq_build_info{version,revision,goversion}     gauge    1: the agent's build (--version)
//	ipmasq_config_loads_total                        counter  loads that changed the applied config
//	ipmasq_config_load_failures_total                counter  rejected files
//	ipmasq_config_valid                              gauge    1 applied, 0 newest file rejected
//	ipmasq_config_generation                         gauge
//	ipmasq_config_last_good_load_timestamp_seconds   gauge
//	ipmasq_config_nonmasq_prefixes{family}           gauge    ipv4, ipv6
//	ipmasq_config_masquerade_prefixes                gauge    masqueradeCIDRs
//	ipmasq_config_masquerade_rules                   gauge    masqueradeRules
//	ipmasq_config_warnings{kind}                     gauge    unknown-key, conflict, odd: warnings of the applied config
//	ipmasq_nonmasq_map_entries{family}               gauge
//	ipmasq_nonmasq_map_capacity{family}              gauge
//	ipmasq_packets_total{family,device,direction,action}  counter  action: translated, passed, dropped; sums to every packet
//	ipmasq_drops_total{family,device,reason}         counter  bpf.DropReason names: nat-table-full, no-free-port, ...
//	ipmasq_nat_port_search_failures_total{family}    counter
//	ipmasq_nat_entries{family}                       gauge
//	ipmasq_nat_capacity{family}                      gauge    per map (--nat-max-entries)
//	ipmasq_nat_pairs{family,kind}                    gauge    the datapath's counts
//	ipmasq_unmasq_flows{family}                      gauge    flows recorded as unmasqueraded (decision kept)
//	ipmasq_unmasq_capacity{family}                   gauge    a quarter of --nat-max-entries
//	ipmasq_datapath_packets_total{counter}           counter  deprecated, removed in the next release: bpf counter names
//	ipmasq_endpoints                                 gauge
//	ipmasq_ip_rules                                  gauge
//	ipmasq_datapath_devices                          gauge
//	ipmasq_datapath_info{variant,reason,attach_mode}  gauge    constant 1: the datapath build loaded (full or compat) and why
//	ipmasq_masquerade_rule_sources                   gauge
//	ipmasq_netfilter_nat_rules                       gauge    netfilter NAT rules that decide before ipmasq
//	ipmasq_reconciler_operation_duration_seconds{module,reconciler,operation}  histogram  update, delete, prune
//	ipmasq_reconciler_rounds_total{module,reconciler}            counter
//	ipmasq_reconciler_errors_total{module,reconciler}            counter
//	ipmasq_reconciler_current_errors{module,reconciler}          gauge
//	ipmasq_reconciler_prunes_total{module,reconciler}            counter
//	ipmasq_reconciler_prune_errors_total{module,reconciler}      counter
//	ipmasq_reconciler_last_prune_successful{module,reconciler}   gauge
package metrics
