package deploy_test

import (
	"bytes"
	"os"
	"os/exec"
	"path"
	"slices"
	"strings"
	"testing"

	"github.com/spf13/pflag"
	batchv1 "k8s.io/api/batch/v1"

	"github.com/ipmasq/ipmasq/testkit/kubetest"
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
	// One Job per node: the node's name in nodeName and the annotation, a
	// hash of it in the Job's name (TestUninstallJobForLongNodeName).
	if str(job.pod, "nodeName") != uninstallNodePlaceholder || str(job.m.obj, "metadata", "annotations", "ipmasq.io/node") != uninstallNodePlaceholder ||
		str(job.m.obj, "metadata", "name") != "ipmasq-uninstall-"+uninstallIDPlaceholder {
		t.Errorf("%s: want nodeName and the annotation ipmasq.io/node %s, the name ipmasq-uninstall-%s (one Job per node)",
			job.m, uninstallNodePlaceholder, uninstallIDPlaceholder)
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

// The placeholders of deploy/uninstall/job.yaml that docs/deploy.md's
// loop replaces, once per node.
const (
	uninstallNodePlaceholder = "replace-with-node-name"
	uninstallIDPlaceholder   = "replace-with-node-id"
)

// uninstallLoopBody returns the shell lines of docs/deploy.md's uninstall
// loop (between `for node in` and `done`), with the trailing
// `| kubectl apply -f -` cut off, so that a test runs exactly what an
// operator runs, on the rendered Job read from stdin.
func uninstallLoopBody(t *testing.T) string {
	t.Helper()
	doc, err := os.ReadFile("../docs/deploy.md")
	if err != nil {
		t.Fatal(err)
	}
	var body []string
	in := false
	for _, line := range strings.Split(string(doc), "\n") {
		switch {
		case strings.HasPrefix(line, "for node in ") && strings.Contains(line, "kubectl get nodes"):
			in = true
		case in && strings.TrimSpace(line) == "done":
			if len(body) == 0 {
				t.Fatal("docs/deploy.md: the uninstall loop is empty")
			}
			return strings.Join(body, "\n")
		case in:
			line = strings.TrimSpace(line)
			if rest, ok := strings.CutSuffix(line, "| kubectl apply -f -"); ok {
				// Stdin instead of kubectl kustomize: the test renders it.
				_, sed, found := strings.Cut(rest, "| sed ")
				if !found {
					t.Fatalf("docs/deploy.md: the uninstall loop's %q has no sed", line)
				}
				line = "sed " + strings.TrimSpace(sed)
			}
			body = append(body, line)
		}
	}
	t.Fatal("docs/deploy.md: no uninstall loop (for node in $(kubectl get nodes ...); do ... done)")
	return ""
}

// renderUninstallJob runs docs/deploy.md's loop body for node on the
// rendered uninstall kustomization, as an operator's shell would.
func renderUninstallJob(t *testing.T, node string) []byte {
	t.Helper()
	cmd := exec.Command("sh", "-euc", uninstallLoopBody(t))
	cmd.Env = append(os.Environ(), "node="+node)
	cmd.Stdin = bytes.NewReader(kubetest.Kustomize(t, "uninstall", ""))
	out, err := cmd.Output()
	if err != nil {
		t.Fatalf("docs/deploy.md's uninstall loop for node %s: %v", node, err)
	}
	return out
}

// longNodeName is an EKS node's name: 47 characters, so
// ipmasq-uninstall-<node> would be 64, one more than a label value holds.
const longNodeName = "ip-10-0-101-230.ap-southeast-2.compute.internal"

// TestUninstallJobNames: docs/deploy.md's loop gives every node a Job of
// its own whose name fits a label value (63 characters) however long the
// node's name, and puts the node's name where the Job runs.
func TestUninstallJobNames(t *testing.T) {
	names := map[string]string{}
	for _, node := range []string{"n1", "n2", longNodeName, strings.Repeat("a", 253)} {
		var job *batchv1.Job
		for _, obj := range kubetest.DecodeYAML(t, "uninstall for "+node, renderUninstallJob(t, node)) {
			if j, ok := obj.(*batchv1.Job); ok {
				job = j
			}
		}
		if job == nil {
			t.Fatalf("node %s: no Job rendered", node)
		}
		if len(job.Name) > 63 {
			t.Errorf("node %s: Job name %s is %d characters, a label value holds 63", node, job.Name, len(job.Name))
		}
		if other, dup := names[job.Name]; dup {
			t.Errorf("nodes %s and %s: one Job name %s", other, node, job.Name)
		}
		names[job.Name] = node
		if job.Spec.Template.Spec.NodeName != node || job.Annotations["ipmasq.io/node"] != node {
			t.Errorf("node %s: Job %s runs on %q, annotated %q", node, job.Name, job.Spec.Template.Spec.NodeName, job.Annotations["ipmasq.io/node"])
		}
		if strings.Contains(string(renderUninstallJob(t, node)), "replace-with-") {
			t.Errorf("node %s: a placeholder is left in the rendered Job", node)
		}
	}
}
