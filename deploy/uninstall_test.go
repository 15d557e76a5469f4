package deploy_test

import (
	"path"
	"slices"
	"strings"
	"testing"

	"github.com/spf13/pflag"

	"github.com/ipmasq/ipmasq/internal/testkit/kubetest"
	"github.com/ipmasq/ipmasq/uninstall"
)

// uninstallJob is the rendered uninstall Job's pod and container.
func uninstallJob(t *testing.T) agentPod {
	t.Helper()
	for _, m := range rendered(t, "uninstall", kubetest.Kustomize(t, "uninstall", "")) {
		if str(m.obj, "kind") != "Job" {
			continue
		}
		pod, _ := get(m.obj, "spec", "template", "spec").(object)
		if cs := list(pod, "containers"); len(cs) == 1 {
			return agentPod{m: m, pod: pod, container: cs[0].(object)}
		}
		t.Fatalf("%s: want one container", m)
	}
	t.Fatal("kustomize uninstall: no Job")
	return agentPod{}
}

// TestUninstallJobMatchesDaemonSet: the Job runs `ipmasq-agent uninstall`
// with flags the command has, on the paths the DaemonSet's agent uses,
// mounted from the same host paths, in the host's network namespace.
func TestUninstallJobMatchesDaemonSet(t *testing.T) {
	job := uninstallJob(t)
	ds := loadAgentPod(t, loadManifests(t))
	if cmd := list(job.container, "command"); len(cmd) != 2 || cmd[0] != "ipmasq-agent" || cmd[1] != "uninstall" {
		t.Fatalf("%s: command %v, want [ipmasq-agent uninstall]", job.m, cmd)
	}
	if get(job.pod, "hostNetwork") != true {
		t.Errorf("%s: hostNetwork must be true: the clsact filters and ip rules are the node's", job.m)
	}
	if str(job.pod, "nodeName") == "" || !strings.Contains(str(job.m.obj, "metadata", "name"), str(job.pod, "nodeName")) {
		t.Errorf("%s: want spec.template.spec.nodeName, and the Job named after it (one Job per node)", job.m)
	}

	opts := uninstall.DefaultOptions
	fs := pflag.NewFlagSet("uninstall", pflag.ContinueOnError)
	opts.Flags(fs)
	for _, a := range job.flagArgs() {
		if err := fs.Set(a.name, a.value); err != nil {
			t.Errorf("%s: %s: ipmasq-agent uninstall rejects it: %v", job.m, a.word, err)
		}
	}
	agent := agentFlags()
	for _, flag := range []string{"bpf-root", "state-dir", "api-socket", "shell-sock-path", "egress-rule-priority"} {
		want, _ := ds.setting(agent, flag)
		if got := fs.Lookup(flag).Value.String(); got != want {
			t.Errorf("%s: --%s=%s, the DaemonSet's agent uses %s", job.m, flag, got, want)
		}
		if flag == "egress-rule-priority" {
			continue
		}
		dir := fs.Lookup(flag).Value.String()
		if strings.HasSuffix(flag, "socket") || strings.HasSuffix(flag, "path") {
			dir = path.Dir(dir)
		}
		jm, dm := job.mountFor(dir), ds.mountFor(dir)
		if jm == nil || dm == nil {
			t.Errorf("--%s %s: mounted in the Job %v, in the DaemonSet %v", flag, dir, jm != nil, dm != nil)
			continue
		}
		jv, dv := job.volume(str(jm, "name")), ds.volume(str(dm, "name"))
		if str(jm, "mountPath") != str(dm, "mountPath") || str(jv, "hostPath", "path") == "" || str(jv, "hostPath", "path") != str(dv, "hostPath", "path") {
			t.Errorf("--%s %s: the Job mounts %v from %v, the DaemonSet %v from %v", flag, dir, jm, jv, dm, dv)
		}
	}

	// Only what the uninstall uses: e2e's TestUninstall runs it with
	// exactly these (setpriv), and the agent's PERFMON is not among them.
	sc := get(job.container, "securityContext")
	var add []string
	for _, c := range list(sc, "capabilities", "add") {
		add = append(add, c.(string))
	}
	slices.Sort(add)
	if drop := list(sc, "capabilities", "drop"); len(drop) != 1 || drop[0] != "ALL" || !slices.Equal(add, []string{"BPF", "NET_ADMIN"}) ||
		get(sc, "privileged") == true || get(sc, "allowPrivilegeEscalation") != false || get(sc, "readOnlyRootFilesystem") != true {
		t.Errorf("%s: securityContext %v: want not privileged, no escalation, read-only root, drop ALL, add BPF and NET_ADMIN", job.m, sc)
	}
}
