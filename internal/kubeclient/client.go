// Package kubeclient connects the agent to the Kubernetes API server: it reads
// --k8s-kubeconfig-path and --k8s-node-name and provides a Client for the
// cells that follow the agent's own Node (its pod CIDRs) and report on it
// (Events). Without a node name the agent runs standalone: Client is
// disabled and nothing talks to an API server.
package kubeclient

import (
	"fmt"
	"os"

	"github.com/cilium/hive/cell"
	"github.com/spf13/pflag"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/serializer"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/clientcmd"
)

// NodeNameEnv is the variable the DaemonSet fills from spec.nodeName with
// the downward API; it is the default of --k8s-node-name.
const NodeNameEnv = "K8S_NODE_NAME"

// Config is the Kubernetes connection's command-line configuration.
type Config struct {
	// K8sKubeconfigPath is a kubeconfig file; empty: the in-cluster config
	// (the pod's ServiceAccount token and KUBERNETES_SERVICE_HOST).
	K8sKubeconfigPath string `mapstructure:"k8s-kubeconfig-path"`
	// K8sNodeName is the Node this agent runs on; empty: no Kubernetes.
	K8sNodeName string `mapstructure:"k8s-node-name"`
}

// Flags implements cell.Flagger. The node name defaults to $K8S_NODE_NAME.
func (def Config) Flags(flags *pflag.FlagSet) {
	node := def.K8sNodeName
	if node == "" {
		node = os.Getenv(NodeNameEnv)
	}
	flags.String("k8s-kubeconfig-path", def.K8sKubeconfigPath,
		"Kubeconfig of the API server (empty: the in-cluster config of the agent's pod)")
	flags.String("k8s-node-name", node,
		"Name of this node's Node object (default $"+NodeNameEnv+"); set: pod CIDRs come from its spec.podCIDRs and Events are posted on it")
}

// Client is the connection to the API server of the agent's cluster.
type Client struct {
	// CoreV1 is a REST client of the core API group (/api/v1), nil when the
	// agent runs without Kubernetes. It knows only the core group's types:
	// the agent reads its Node and posts Events, and client-go's clientset
	// (every API group's client and types) made the binary's pages the
	// larger part of the agent's RSS.
	CoreV1 rest.Interface
	// NodeName is the agent's own Node.
	NodeName string
}

// Enabled reports whether the agent talks to Kubernetes.
func (c *Client) Enabled() bool { return c.CoreV1 != nil }

// Cell provides *Client.
var Cell = cell.Module(
	"k8s-client",
	"Kubernetes API server connection",

	cell.Config(Config{}),
	cell.Provide(newClient),
)

func newClient(cfg Config) (*Client, error) {
	if cfg.K8sNodeName == "" {
		if cfg.K8sKubeconfigPath != "" {
			return nil, fmt.Errorf("--k8s-kubeconfig-path=%s needs --k8s-node-name (or $%s): the agent follows its own Node", cfg.K8sKubeconfigPath, NodeNameEnv)
		}
		return &Client{}, nil
	}
	rc, err := restConfig(cfg.K8sKubeconfigPath)
	if err != nil {
		return nil, err
	}
	rc.UserAgent = "ipmasq-agent/" + cfg.K8sNodeName
	cs, err := coreClient(rc)
	if err != nil {
		return nil, fmt.Errorf("kubernetes client: %w", err)
	}
	return &Client{CoreV1: cs, NodeName: cfg.K8sNodeName}, nil
}

func restConfig(path string) (*rest.Config, error) {
	if path != "" {
		rc, err := clientcmd.BuildConfigFromFlags("", path)
		if err != nil {
			return nil, fmt.Errorf("--k8s-kubeconfig-path=%s: %w", path, err)
		}
		return rc, nil
	}
	rc, err := rest.InClusterConfig()
	if err != nil {
		return nil, fmt.Errorf("--k8s-node-name is set but --k8s-kubeconfig-path is not, and the in-cluster config is unusable (not running in a pod?): %w", err)
	}
	return rc, nil
}

// coreScheme holds the core group's types (Node, Event, their lists, and
// the meta types the API server answers with).
var coreScheme = func() *runtime.Scheme {
	s := runtime.NewScheme()
	if err := corev1.AddToScheme(s); err != nil {
		panic(err)
	}
	metav1.AddToGroupVersion(s, corev1.SchemeGroupVersion)
	return s
}()

// coreClient is a REST client of /api/v1 that speaks JSON.
func coreClient(rc *rest.Config) (*rest.RESTClient, error) {
	cfg := *rc
	cfg.APIPath = "/api"
	cfg.GroupVersion = &corev1.SchemeGroupVersion
	cfg.ContentType = runtime.ContentTypeJSON
	cfg.NegotiatedSerializer = serializer.NewCodecFactory(coreScheme).WithoutConversion()
	return rest.RESTClientFor(&cfg)
}
