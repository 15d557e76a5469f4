// Package kubetest runs a real Kubernetes API server for tests: etcd (the
// Debian etcd-server package) and kube-apiserver (built from the
// tools/kube-apiserver module) inside a network namespace of their own, so
// that nothing listens on the host's network and node namespaces can reach
// it over a veth. Authentication is by static tokens, authorization is RBAC.
//
// It is test support only: production code never imports it.
package kubetest

import (
	"context"
	"crypto/rand"
	"crypto/rsa"
	"crypto/x509"
	"encoding/pem"
	"fmt"
	"net"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/clientcmd"
	clientcmdapi "k8s.io/client-go/tools/clientcmd/api"

	"github.com/ipmasq/ipmasq/cmd/ipmasq-demo/topology"
)

// Identities with a static token.
const (
	// AdminToken authenticates as a member of system:masters.
	AdminToken = "admin-token"
	// AgentToken authenticates as the agent's ServiceAccount
	// (system:serviceaccount:kube-system:ipmasq-agent) and nothing more:
	// it has exactly the permissions RBAC grants that ServiceAccount.
	AgentToken = "agent-token"
	// AgentUser is the user name of AgentToken.
	AgentUser = "system:serviceaccount:kube-system:ipmasq-agent"
)

// Addr is the API server's address, on the loopback device of its
// namespace; a node namespace reaches it through a route (see Server.Netns).
var Addr = netip.MustParseAddr("10.99.0.1")

// Port is the API server's secure port.
const Port = 6443

// Server is etcd and kube-apiserver running in the namespace Netns.
type Server struct {
	// Netns holds etcd and the API server. Connect it to a topology with a
	// veth and routes to reach Addr from other namespaces.
	Netns *topology.Netns
	// CertFile is the API server's self-signed certificate (with its CA).
	CertFile string

	t       testing.TB
	dir     string
	bin     string
	etcd    *exec.Cmd
	api     *exec.Cmd
	apiArgs []string
}

// Start runs etcd and the API server and waits until the API server is
// ready. A missing etcd or a failed build fails the test: the Kubernetes
// tests are never skipped. Everything stops when the test ends.
func Start(t testing.TB) *Server {
	t.Helper()
	if _, err := exec.LookPath("etcd"); err != nil {
		t.Fatalf("etcd not found (%v): install the Debian package etcd-server (.ci/run does)", err)
	}
	bin, err := APIServerBinary()
	if err != nil {
		t.Fatalf("kube-apiserver: %v", err)
	}
	ns, err := topology.NewNetns("kube-api")
	if err != nil {
		t.Fatalf("network namespace for the API server: %v", err)
	}
	s := &Server{Netns: ns, t: t, dir: t.TempDir(), bin: bin}
	t.Cleanup(s.close)
	if err := ns.Addr("lo", Addr.String()+"/32"); err != nil {
		t.Fatal(err)
	}
	if err := s.prepare(); err != nil {
		t.Fatal(err)
	}
	s.startEtcd()
	s.Restart()
	return s
}

func (s *Server) prepare() error {
	key, err := rsa.GenerateKey(rand.Reader, 2048)
	if err != nil {
		return fmt.Errorf("service-account key: %w", err)
	}
	keyFile := filepath.Join(s.dir, "sa.key")
	der := x509.MarshalPKCS1PrivateKey(key)
	if err := os.WriteFile(keyFile, pem.EncodeToMemory(&pem.Block{Type: "RSA PRIVATE KEY", Bytes: der}), 0o600); err != nil {
		return err
	}
	tokens := filepath.Join(s.dir, "tokens.csv")
	content := AdminToken + ",admin,admin,system:masters\n" +
		AgentToken + "," + AgentUser + ",ipmasq-agent,\"system:serviceaccounts,system:serviceaccounts:kube-system\"\n"
	if err := os.WriteFile(tokens, []byte(content), 0o600); err != nil {
		return err
	}
	certDir := filepath.Join(s.dir, "certs")
	s.CertFile = filepath.Join(certDir, "apiserver.crt")
	s.apiArgs = []string{
		"--etcd-servers=http://127.0.0.1:2379",
		"--bind-address=0.0.0.0",
		"--advertise-address=" + Addr.String(),
		fmt.Sprintf("--secure-port=%d", Port),
		"--cert-dir=" + certDir,
		"--token-auth-file=" + tokens,
		"--authorization-mode=RBAC",
		"--service-account-issuer=https://kubernetes.default.svc",
		"--service-account-key-file=" + keyFile,
		"--service-account-signing-key-file=" + keyFile,
		"--service-cluster-ip-range=10.96.0.0/16",
		// Reads and watches straight from etcd. With its watch cache the
		// server, restarted during a test (the real node's API server
		// outage), answered some reads from a cache it could not prove
		// current with Debian's etcd 3.4 ("read version ... is not as new
		// as written version"), and the kubelet then never saw pods
		// deleted. The tests' clusters are small: etcd serves them.
		"--watch-cache=false",
	}
	return nil
}

func (s *Server) startEtcd() {
	s.t.Helper()
	data := filepath.Join(s.dir, "etcd")
	s.etcd = s.command("etcd", "etcd.log",
		"--data-dir="+data,
		"--listen-client-urls=http://127.0.0.1:2379",
		"--advertise-client-urls=http://127.0.0.1:2379",
		"--listen-peer-urls=http://127.0.0.1:2380",
		"--initial-advertise-peer-urls=http://127.0.0.1:2380",
		"--initial-cluster=default=http://127.0.0.1:2380")
}

// command starts a process in the namespace with its output in logName.
func (s *Server) command(bin, logName string, args ...string) *exec.Cmd {
	s.t.Helper()
	log, err := os.OpenFile(filepath.Join(s.dir, logName), os.O_CREATE|os.O_APPEND|os.O_WRONLY, 0o644)
	if err != nil {
		s.t.Fatal(err)
	}
	defer log.Close()
	cmd := exec.Command(bin, args...)
	cmd.Stdout, cmd.Stderr = log, log
	// Stop with the test binary even if it dies without cleanup.
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	if err := s.Netns.Start(cmd); err != nil {
		s.t.Fatalf("start %s: %v", bin, err)
	}
	return cmd
}

// Restart starts the API server (again, after Kill) and waits until it is
// ready: /readyz answers ok and the kube-system namespace exists.
func (s *Server) Restart() {
	s.t.Helper()
	s.api = s.command(s.bin, "kube-apiserver.log", s.apiArgs...)
	deadline := time.Now().Add(90 * time.Second)
	var last error
	for ; time.Now().Before(deadline); time.Sleep(200 * time.Millisecond) {
		if s.api.ProcessState != nil {
			break
		}
		// The server writes its self-signed certificate at start.
		if _, err := os.Stat(s.CertFile); err != nil {
			last = err
			continue
		}
		c, err := kubernetes.NewForConfig(s.RESTConfig(AdminToken))
		if err != nil {
			last = err
			continue
		}
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
		body, err := c.Discovery().RESTClient().Get().AbsPath("/readyz").DoRaw(ctx)
		if err == nil && strings.TrimSpace(string(body)) == "ok" {
			_, err = c.CoreV1().Namespaces().Get(ctx, "kube-system", metav1.GetOptions{})
			if err == nil {
				cancel()
				return
			}
		}
		cancel()
		last = err
	}
	s.t.Fatalf("kube-apiserver not ready: %v\n%s", last, s.logTail("kube-apiserver.log"))
}

// Kill stops the API server at once (SIGKILL); etcd keeps running.
func (s *Server) Kill() {
	if s.api == nil || s.api.Process == nil {
		return
	}
	s.api.Process.Kill()
	s.api.Wait()
	s.api = nil
}

func (s *Server) close() {
	s.Kill()
	if s.etcd != nil && s.etcd.Process != nil {
		s.etcd.Process.Kill()
		s.etcd.Wait()
	}
	if s.t.Failed() {
		s.t.Logf("kube-apiserver log:\n%s\netcd log:\n%s", s.logTail("kube-apiserver.log"), s.logTail("etcd.log"))
	}
	s.Netns.Close()
}

func (s *Server) logTail(name string) string {
	data, err := os.ReadFile(filepath.Join(s.dir, name))
	if err != nil {
		return err.Error()
	}
	lines := strings.Split(strings.TrimSpace(string(data)), "\n")
	if len(lines) > 40 {
		lines = lines[len(lines)-40:]
	}
	return strings.Join(lines, "\n")
}

// URL is the API server's address as a client in a connected namespace
// uses it.
func (s *Server) URL() string { return fmt.Sprintf("https://%s:%d", Addr, Port) }

// RESTConfig is a client configuration for token whose connections are
// made inside the API server's namespace, so a test process in any
// namespace can use it.
func (s *Server) RESTConfig(token string) *rest.Config {
	return &rest.Config{
		Host:            s.URL(),
		BearerToken:     token,
		TLSClientConfig: rest.TLSClientConfig{CAFile: s.CertFile},
		Dial:            s.dial,
		Timeout:         10 * time.Second,
	}
}

// dial connects from inside the API server's namespace: a socket belongs to
// the namespace of the thread that created it for its whole life.
func (s *Server) dial(ctx context.Context, network, addr string) (net.Conn, error) {
	var conn net.Conn
	err := s.Netns.Do(func() error {
		var err error
		conn, err = (&net.Dialer{}).DialContext(ctx, network, addr)
		return err
	})
	return conn, err
}

// Client is a clientset for token (see RESTConfig).
func (s *Server) Client(token string) kubernetes.Interface {
	s.t.Helper()
	c, err := kubernetes.NewForConfig(s.RESTConfig(token))
	if err != nil {
		s.t.Fatalf("client: %v", err)
	}
	return c
}

// WriteKubeconfig writes a kubeconfig for token to path, for a process in a
// namespace that routes to Addr.
func (s *Server) WriteKubeconfig(path, token string) {
	s.t.Helper()
	cfg := clientcmdapi.NewConfig()
	cfg.Clusters["test"] = &clientcmdapi.Cluster{Server: s.URL(), CertificateAuthority: s.CertFile}
	cfg.AuthInfos["test"] = &clientcmdapi.AuthInfo{Token: token}
	cfg.Contexts["test"] = &clientcmdapi.Context{Cluster: "test", AuthInfo: "test"}
	cfg.CurrentContext = "test"
	if err := clientcmd.WriteToFile(*cfg, path); err != nil {
		s.t.Fatalf("write kubeconfig: %v", err)
	}
}
