// Package deploy_test checks the Kubernetes manifests in this directory
// against the agent they deploy: every flag and IPMASQ_* variable the
// DaemonSet passes is one the agent has (with a value it accepts), the
// config the ConfigMap holds is one the agent accepts, and the mounts give
// the agent what its flags point at.
//
// The manifests are read as generic maps (sigs.k8s.io/yaml), so there is
// no dependency on the Kubernetes API types.
//
//	go test ./deploy/
package deploy_test

import (
	"fmt"
	"log/slog"
	"net"
	"os"
	"path"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"testing"

	"github.com/spf13/pflag"
	"sigs.k8s.io/yaml"

	"github.com/ipmasq/ipmasq/agent"
	"github.com/ipmasq/ipmasq/cells/config"
	"github.com/ipmasq/ipmasq/readers/metrics"
	"github.com/ipmasq/ipmasq/testkit/kubetest"
)

// object is one Kubernetes object as decoded from YAML.
type object = map[string]any

// manifest is one object and where it came from, for error messages.
type manifest struct {
	file string
	doc  int
	obj  object
}

func (m manifest) String() string {
	return fmt.Sprintf("%s (document %d, %s %s)", m.file, m.doc, str(m.obj, "kind"), str(m.obj, "metadata", "name"))
}

// manifestFiles are the manifests: deploy/*.yaml (what "kubectl apply -f
// deploy/" applies) and the example ConfigMap in deploy/config/, kept apart
// so that applying deploy/ never overwrites a ConfigMap the cluster has.
func manifestFiles() ([]string, error) {
	top, err := filepath.Glob("*.yaml")
	if err != nil {
		return nil, err
	}
	cfg, err := filepath.Glob("config/*.yaml")
	return append(top, cfg...), err
}

// docSeparator splits a multi-document YAML file.
var docSeparator = regexp.MustCompile(`(?m)^---[ \t]*$`)

func loadManifests(t *testing.T) []manifest {
	t.Helper()
	files, err := manifestFiles()
	if err != nil {
		t.Fatal(err)
	}
	if len(files) == 0 {
		t.Fatal("no *.yaml in deploy/")
	}
	var out []manifest
	for _, f := range files {
		if f == "kustomization.yaml" {
			continue // kustomize_test.go renders it
		}
		data, err := os.ReadFile(f)
		if err != nil {
			t.Fatal(err)
		}
		for i, doc := range docSeparator.Split(string(data), -1) {
			var obj object
			if err := yaml.Unmarshal([]byte(doc), &obj); err != nil {
				t.Fatalf("%s: document %d: %v", f, i+1, err)
			}
			if len(obj) == 0 {
				continue // comments only
			}
			m := manifest{file: f, doc: i + 1, obj: obj}
			if str(obj, "apiVersion") == "" || str(obj, "kind") == "" || str(obj, "metadata", "name") == "" {
				t.Errorf("%s: want apiVersion, kind and metadata.name", m)
			}
			out = append(out, m)
		}
	}
	return out
}

// find returns the objects of a kind.
func find(ms []manifest, kind string) []manifest {
	var out []manifest
	for _, m := range ms {
		if str(m.obj, "kind") == kind {
			out = append(out, m)
		}
	}
	return out
}

// get walks nested maps; nil when a key is missing.
func get(v any, keys ...string) any {
	for _, k := range keys {
		m, ok := v.(map[string]any)
		if !ok {
			return nil
		}
		v = m[k]
	}
	return v
}

func str(v any, keys ...string) string {
	s, _ := get(v, keys...).(string)
	return s
}

func list(v any, keys ...string) []any {
	l, _ := get(v, keys...).([]any)
	return l
}

// agentFlags is the agent's real flag set: the hive's flags plus the root
// command's own --log-level (cmd/ipmasq-agent).
func agentFlags() *pflag.FlagSet {
	fs := pflag.NewFlagSet("ipmasq-agent", pflag.ContinueOnError)
	agent.New().RegisterFlags(fs)
	if fs.Lookup("log-level") == nil {
		fs.Var(&logLevel{"info"}, "log-level", "Log level: debug, info, warn or error")
	}
	return fs
}

// logLevel accepts what the root command's newLogger accepts.
type logLevel struct{ s string }

func (l *logLevel) String() string { return l.s }
func (l *logLevel) Type() string   { return "string" }
func (l *logLevel) Set(s string) error {
	var lv slog.Level
	if err := lv.UnmarshalText([]byte(s)); err != nil {
		return fmt.Errorf("want debug, info, warn or error")
	}
	l.s = s
	return nil
}

// envName is the variable that sets a flag (hive's EnvPrefix convention).
func envName(flag string) string {
	return agent.EnvPrefix + strings.ToUpper(strings.ReplaceAll(flag, "-", "_"))
}

// agentPod is the DaemonSet's pod spec and its agent container.
type agentPod struct {
	m         manifest
	pod       object
	container object
}

func loadAgentPod(t *testing.T, ms []manifest) agentPod {
	t.Helper()
	var ds *manifest
	for _, m := range find(ms, "DaemonSet") {
		if str(m.obj, "metadata", "name") == "ipmasq-agent" {
			ds = &m
		}
	}
	if ds == nil {
		t.Fatal("no DaemonSet ipmasq-agent in deploy/*.yaml")
	}
	pod, _ := get(ds.obj, "spec", "template", "spec").(object)
	if pod == nil {
		t.Fatalf("%s: no spec.template.spec", ds)
	}
	for _, c := range list(pod, "containers") {
		if str(c, "name") == "ipmasq-agent" {
			return agentPod{m: *ds, pod: pod, container: c.(object)}
		}
	}
	t.Fatalf("%s: no container ipmasq-agent", ds)
	return agentPod{}
}

// flagArgs are the --name[=value] words of the container's command and args.
type flagArg struct{ name, value, word string }

func (p agentPod) flagArgs() []flagArg {
	var out []flagArg
	for _, w := range append(list(p.container, "command"), list(p.container, "args")...) {
		s, _ := w.(string)
		if !strings.HasPrefix(s, "--") {
			continue
		}
		name, value, _ := strings.Cut(strings.TrimPrefix(s, "--"), "=")
		out = append(out, flagArg{name, value, s})
	}
	return out
}

// setting is the value the container gives a flag: from args, else from
// an IPMASQ_* variable, else the agent's default.
func (p agentPod) setting(fs *pflag.FlagSet, flag string) (string, bool) {
	for _, a := range p.flagArgs() {
		if a.name == flag {
			return a.value, true
		}
	}
	for _, e := range list(p.container, "env") {
		if str(e, "name") == envName(flag) {
			return str(e, "value"), true
		}
	}
	if f := fs.Lookup(flag); f != nil {
		return f.DefValue, false
	}
	return "", false
}

// mountFor is the volumeMount whose mountPath is dir or contains it.
func (p agentPod) mountFor(dir string) object {
	var best object
	for _, vm := range list(p.container, "volumeMounts") {
		mp := path.Clean(str(vm, "mountPath"))
		if (dir == mp || strings.HasPrefix(dir, mp+"/")) && len(mp) > len(str(best, "mountPath")) {
			best = vm.(object)
		}
	}
	return best
}

func (p agentPod) volume(name string) object {
	for _, v := range list(p.pod, "volumes") {
		if str(v, "name") == name {
			return v.(object)
		}
	}
	return nil
}

// TestFlagsExistInAgent: a manifest that names a flag the agent lacks (or
// gives a value it rejects) crash-loops on every node; catch it here.
func TestFlagsExistInAgent(t *testing.T) {
	p := loadAgentPod(t, loadManifests(t))
	fs := agentFlags()
	var missing []string
	for _, a := range p.flagArgs() {
		if fs.Lookup(a.name) == nil {
			missing = append(missing, "--"+a.name)
			continue
		}
		if strings.Contains(a.value, "$(") {
			continue // a Kubernetes $(VAR) reference, expanded by the kubelet
		}
		if err := fs.Set(a.name, a.value); err != nil {
			t.Errorf("%s: %s: the agent rejects the value: %v", p.m, a.word, err)
		}
	}
	envs := map[string]string{}
	fs.VisitAll(func(f *pflag.Flag) { envs[envName(f.Name)] = f.Name })
	for _, e := range list(p.container, "env") {
		name := str(e, "name")
		if !strings.HasPrefix(name, agent.EnvPrefix) {
			continue
		}
		flag, ok := envs[name]
		if !ok {
			missing = append(missing, name)
			continue
		}
		if v, ok := get(e, "value").(string); ok {
			if err := fs.Set(flag, v); err != nil {
				t.Errorf("%s: %s=%q: the agent rejects the value: %v", p.m, name, v, err)
			}
		}
	}
	if len(missing) > 0 {
		t.Errorf("%s names settings the agent does not have: %s (see ipmasq-agent --help)",
			p.m, strings.Join(missing, ", "))
	}
}

// TestConfigMapIsTheConfigFile: the config path flag names
// <mountPath>/<key> of a whole-ConfigMap mount, and the agent accepts the
// config in it.
func TestConfigMapIsTheConfigFile(t *testing.T) {
	ms := loadManifests(t)
	p := loadAgentPod(t, ms)
	cfgPath, _ := p.setting(agentFlags(), "ip-masq-agent-config-path")
	dir, key := path.Dir(cfgPath), path.Base(cfgPath)

	vm := p.mountFor(dir)
	if vm == nil || path.Clean(str(vm, "mountPath")) != dir {
		t.Fatalf("%s: --ip-masq-agent-config-path=%s but no volume is mounted at %s", p.m, cfgPath, dir)
	}
	vol := p.volume(str(vm, "name"))
	cmName := str(vol, "configMap", "name")
	if cmName == "" {
		t.Fatalf("%s: the volume mounted at %s is not a ConfigMap", p.m, dir)
	}
	fileKey := key
	if items := list(vol, "configMap", "items"); items != nil {
		fileKey = ""
		for _, it := range items {
			if str(it, "path") == key {
				fileKey = str(it, "key")
			}
		}
		if fileKey == "" {
			t.Fatalf("%s: configMap volume %q has items, none with path %s", p.m, str(vol, "name"), key)
		}
	}

	ns := str(p.m.obj, "metadata", "namespace")
	var data string
	found := false
	for _, cm := range find(ms, "ConfigMap") {
		if str(cm.obj, "metadata", "name") != cmName || str(cm.obj, "metadata", "namespace") != ns {
			continue
		}
		d, ok := get(cm.obj, "data", fileKey).(string)
		if !ok {
			t.Fatalf("%s: no key %q, the file name --ip-masq-agent-config-path=%s points to", cm, fileKey, cfgPath)
		}
		data, found = d, true
	}
	if !found {
		t.Fatalf("no ConfigMap %s/%s, which %s mounts at %s", ns, cmName, p.m, dir)
	}

	lim := config.Limits{EnableIPv4: true, EnableIPv6: true}
	if _, err := config.Parse(cfgPath, []byte(data), lim); err != nil {
		t.Errorf("the agent rejects the ConfigMap's config: %v", err)
	}
	// The commented masqueradeRules example must work once uncommented.
	if example, ok := uncommentFrom(data, "masqueradeRules:"); ok {
		if _, err := config.Parse(cfgPath, []byte(example), lim); err != nil {
			t.Errorf("the commented masqueradeRules example, uncommented, is rejected: %v", err)
		}
	} else {
		t.Errorf("the ConfigMap's config has no commented masqueradeRules example")
	}
}

// uncommentFrom removes "# " from the commented line that reads marker and
// from every commented line after it.
func uncommentFrom(data, marker string) (string, bool) {
	lines := strings.Split(data, "\n")
	found := false
	for i, l := range lines {
		indent := l[:len(l)-len(strings.TrimLeft(l, " "))]
		rest := strings.TrimPrefix(l[len(indent):], "# ")
		if !found && rest == marker && rest != l[len(indent):] {
			found = true
		}
		if found && strings.HasPrefix(l[len(indent):], "# ") {
			lines[i] = indent + rest
		}
	}
	return strings.Join(lines, "\n"), found
}

// TestConfigMapMountHasNoSubPath: a subPath mount of a ConfigMap is never
// updated by the kubelet, so an edited config would never reach the agent.
func TestConfigMapMountHasNoSubPath(t *testing.T) {
	p := loadAgentPod(t, loadManifests(t))
	for _, vm := range list(p.container, "volumeMounts") {
		if str(p.volume(str(vm, "name")), "configMap", "name") == "" {
			continue
		}
		if str(vm, "subPath") != "" || str(vm, "subPathExpr") != "" {
			t.Errorf("%s: ConfigMap volume %q is mounted with a subPath: the kubelet never updates it, so config edits would not reach the agent",
				p.m, str(vm, "name"))
		}
	}
}

// TestPodSecurity: host network, and no more privilege than the
// capabilities it names.
func TestPodSecurity(t *testing.T) {
	p := loadAgentPod(t, loadManifests(t))
	if get(p.pod, "hostNetwork") != true {
		t.Errorf("%s: hostNetwork must be true: the agent works on the node's devices, rules and sysctls", p.m)
	}
	sc := get(p.container, "securityContext")
	if get(sc, "privileged") == true {
		t.Errorf("%s: the container must not be privileged", p.m)
	}
	if get(sc, "readOnlyRootFilesystem") != true {
		t.Errorf("%s: want readOnlyRootFilesystem: true", p.m)
	}
	dropsAll := false
	for _, c := range list(sc, "capabilities", "drop") {
		dropsAll = dropsAll || c == "ALL"
	}
	if !dropsAll {
		t.Errorf("%s: want capabilities.drop: [ALL], adding back only what the agent needs", p.m)
	}
}

// TestWritablePathsAreVolumes: with a read-only root filesystem, every path
// the agent writes must be on a writable volume.
func TestWritablePathsAreVolumes(t *testing.T) {
	p := loadAgentPod(t, loadManifests(t))
	fs := agentFlags()
	for _, w := range []struct {
		flag string
		dir  func(string) string
	}{
		{"bpf-root", path.Clean},
		{"state-dir", path.Clean},
		{"api-socket", path.Dir},
		{"shell-sock-path", path.Dir},
	} {
		v, _ := p.setting(fs, w.flag)
		if v == "" {
			continue // unset and no default: nothing is written
		}
		dir := w.dir(v)
		vm := p.mountFor(dir)
		if vm == nil {
			t.Errorf("%s: --%s=%s: no volume is mounted at %s (the root filesystem is read-only)", p.m, w.flag, v, dir)
			continue
		}
		if get(vm, "readOnly") == true {
			t.Errorf("%s: --%s=%s: volume %q is mounted read-only", p.m, w.flag, v, str(vm, "name"))
		}
	}
}

// TestProbesUseMetricsPort: the probes must reach the agent's HTTP server,
// which listens on --prometheus-serve-addr.
func TestProbesUseMetricsPort(t *testing.T) {
	p := loadAgentPod(t, loadManifests(t))
	addr, _ := p.setting(agentFlags(), "prometheus-serve-addr")
	if addr == "" {
		t.Fatalf("%s: --prometheus-serve-addr is not set: nothing serves the probes", p.m)
	}
	_, portStr, err := net.SplitHostPort(addr)
	if err != nil {
		t.Fatalf("%s: --prometheus-serve-addr=%s: %v", p.m, addr, err)
	}
	want, _ := strconv.Atoi(portStr)

	named := map[string]int{}
	for _, cp := range list(p.container, "ports") {
		if n, ok := get(cp, "containerPort").(float64); ok {
			named[str(cp, "name")] = int(n)
		}
	}
	probes := 0
	for _, kind := range []string{"livenessProbe", "readinessProbe", "startupProbe"} {
		probe := get(p.container, kind)
		if probe == nil {
			continue
		}
		probes++
		var got int
		switch port := get(probe, "httpGet", "port").(type) {
		case float64:
			got = int(port)
		case string:
			n, ok := named[port]
			if !ok {
				t.Errorf("%s: %s: no container port named %q", p.m, kind, port)
				continue
			}
			got = n
		default:
			t.Errorf("%s: %s: want an httpGet probe", p.m, kind)
			continue
		}
		if got != want {
			t.Errorf("%s: %s probes port %d, but the agent serves on %s", p.m, kind, got, addr)
		}
	}
	if probes < 2 {
		t.Errorf("%s: want liveness and readiness probes", p.m)
	}
}

// TestProbePaths: readiness is /readyz (what the node can do: a rollout
// stops at a node that cannot), liveness is /livez (the agent answers).
// Neither is /healthz: a liveness probe on it would restart an agent for a
// rejected config edit or an unreadable Node, which no restart fixes.
func TestProbePaths(t *testing.T) {
	p := loadAgentPod(t, loadManifests(t))
	for kind, want := range map[string]string{"readinessProbe": metrics.ReadyPath, "livenessProbe": metrics.LivePath} {
		if got := str(get(p.container, kind), "httpGet", "path"); got != want {
			t.Errorf("%s: %s path %q, want %q", p.m, kind, got, want)
		}
	}
}

// TestVolumeMountsHaveVolumes: a mount of a volume the pod does not define
// is rejected by the API server; catch the typo here.
func TestVolumeMountsHaveVolumes(t *testing.T) {
	p := loadAgentPod(t, loadManifests(t))
	for _, vm := range list(p.container, "volumeMounts") {
		if p.volume(str(vm, "name")) == nil {
			t.Errorf("%s: volumeMount %q (at %s) has no volume", p.m, str(vm, "name"), str(vm, "mountPath"))
		}
	}
}

// clusterScoped are the kinds in deploy/ that have no namespace.
var clusterScoped = map[string]bool{"Namespace": true, "ClusterRole": true, "ClusterRoleBinding": true}

// TestReferencesResolve: the ServiceAccount exists, the ClusterRoleBinding
// binds the ClusterRole to it, and everything namespaced is in one
// namespace.
func TestReferencesResolve(t *testing.T) {
	ms := loadManifests(t)
	p := loadAgentPod(t, ms)
	ns := str(p.m.obj, "metadata", "namespace")
	for _, m := range ms {
		if clusterScoped[str(m.obj, "kind")] {
			if got := str(m.obj, "metadata", "namespace"); got != "" {
				t.Errorf("%s: cluster-scoped, but has namespace %q", m, got)
			}
			continue
		}
		if got := str(m.obj, "metadata", "namespace"); got != ns {
			t.Errorf("%s: namespace %q, want %q like the DaemonSet", m, got, ns)
		}
	}
	sa := str(p.pod, "serviceAccountName")
	found := false
	for _, m := range find(ms, "ServiceAccount") {
		found = found || str(m.obj, "metadata", "name") == sa
	}
	if !found {
		t.Errorf("%s: serviceAccountName %q is not defined in deploy/*.yaml", p.m, sa)
	}
	bound := false
	for _, m := range find(ms, "ClusterRoleBinding") {
		role := str(m.obj, "roleRef", "name")
		if len(find(ms, "ClusterRole")) == 0 || str(m.obj, "roleRef", "kind") != "ClusterRole" {
			continue
		}
		for _, s := range list(m.obj, "subjects") {
			if str(s, "kind") == "ServiceAccount" && str(s, "name") == sa && str(s, "namespace") == ns && role != "" {
				bound = true
			}
		}
	}
	if !bound {
		t.Errorf("no ClusterRoleBinding in deploy/*.yaml binds a ClusterRole to ServiceAccount %s/%s", ns, sa)
	}
}

// TestApplyLeavesExistingConfigMapAlone: "kubectl apply" patches every
// object it names, so a ConfigMap in the install (kubectl apply -k deploy/,
// or -f deploy/*.yaml) would overwrite the config an operator already has
// (the Kubernetes agent's ConfigMap has the same name and key). The example
// lives in deploy/config/, created with "kubectl create", which refuses to
// overwrite.
func TestApplyLeavesExistingConfigMapAlone(t *testing.T) {
	for _, m := range loadManifests(t) {
		if str(m.obj, "kind") == "ConfigMap" && filepath.Dir(m.file) == "." {
			t.Errorf("%s: a ConfigMap among deploy/*.yaml: applying deploy/ would replace an existing one's data", m)
		}
	}
	for _, dir := range kustomizations {
		for _, m := range rendered(t, dir, kubetest.Kustomize(t, dir, "")) {
			if str(m.obj, "kind") == "ConfigMap" {
				t.Errorf("%s: kubectl apply -k %s would replace an existing ConfigMap's data", m, dir)
			}
		}
	}
}
