{{- define "kubetrain.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "kubetrain.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- define "kubetrain.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{ include "kubetrain.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: kubetrain
{{- end -}}

{{- define "kubetrain.selectorLabels" -}}
app.kubernetes.io/name: {{ include "kubetrain.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: operator
{{- end -}}

{{- define "kubetrain.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "kubetrain.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{/* The namespaces watched in `namespaced` scope, as a JSON list (fromJsonArray reads it back):
rbac.watchNamespaces, else the one rbac.watchNamespace, else the release namespace. */}}
{{- define "kubetrain.watchNamespaces" -}}
{{- $many := .Values.rbac.watchNamespaces | default list -}}
{{- if and $many .Values.rbac.watchNamespace -}}
{{- fail "rbac.watchNamespace and rbac.watchNamespaces are both set: list every namespace in rbac.watchNamespaces" -}}
{{- end -}}
{{- $many | default (list (default .Release.Namespace .Values.rbac.watchNamespace)) | uniq | toJson -}}
{{- end -}}

{{/* matchResources of an admission policy's binding in `namespaced` scope: the watched namespaces only. */}}
{{- define "kubetrain.watchNamespaceSelector" -}}
namespaceSelector:
  matchExpressions:
  - key: kubernetes.io/metadata.name
    operator: In
    values: {{ include "kubetrain.watchNamespaces" . }}
{{- end -}}

{{/* "true" when leader election is on (explicitly, or auto with more than one replica). */}}
{{- define "kubetrain.leaderElection" -}}
{{- $p := .Values.leaderElection.enabled | toString -}}
{{- if or (eq $p "true") (and (eq $p "auto") (gt (int .Values.operator.replicas) 1)) -}}true{{- end -}}
{{- end -}}

{{/* Labels of a ServiceMonitor, PodMonitor or PrometheusRule: the chart's, `release` where metrics.release
is set (the label kube-prometheus-stack selects on), then the object's own (`labels` of its values). */}}
{{- define "kubetrain.monitorLabels" -}}
{{ include "kubetrain.labels" .root }}
{{- with .root.Values.metrics.release }}
release: {{ . | quote }}
{{- end }}
{{- with .labels }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{- define "kubetrain.monitorApiVersion" -}}
{{- if eq .Values.metrics.flavor "azure-managed" -}}azmonitoring.coreos.com/v1
{{- else if eq .Values.metrics.flavor "gke-managed" -}}monitoring.googleapis.com/v1
{{- else -}}monitoring.coreos.com/v1
{{- end -}}
{{- end -}}

{{/* Rules on namespaced objects: a ClusterRole in `cluster` scope, a Role in `namespaced` scope. No Secrets. */}}
{{- define "kubetrain.namespacedRules" -}}
- apiGroups: ["kubetrain.io"]
  resources: ["trainingjobs"]
  verbs: ["get", "list", "watch", "patch", "delete"]
- apiGroups: ["kubetrain.io"]
  resources: ["trainingjobs/status"]
  verbs: ["get", "patch"]
# A job's spec.runtimeRef: read while the job has not started (status.runtime keeps it then).
- apiGroups: ["kubetrain.io"]
  resources: ["trainingruntimes"]
  verbs: ["get"]
# patch: a profile request (the job's kubetrain.io/profile annotation) copied onto worker 0, and so that
# the per-job Role below may grant it (the API server refuses a Role that grants more than its creator holds).
- apiGroups: [""]
  resources: ["pods"]
  verbs: ["get", "list", "watch", "create", "delete", "patch"]
# serviceaccounts: per job <job>-worker, which only that job's pods run as (the progress Role's subject).
- apiGroups: [""]
  resources: ["services", "persistentvolumeclaims", "serviceaccounts"]
  verbs: ["get", "create"]
- apiGroups: [""]
  resources: ["configmaps"]
  verbs: ["get", "create", "patch"]  # patch: a new gang after a spec edit reads the new config
- apiGroups: [""]
  resources: ["events"]
  verbs: ["create", "patch"]
# Per job, Role + RoleBinding <job>-progress: the workers may get/patch their pod <job>-worker-0
# (rank 0's progress annotation). Owned by the TrainingJob: the garbage collector deletes them.
- apiGroups: ["rbac.authorization.k8s.io"]
  resources: ["roles", "rolebindings"]
  verbs: ["get", "create"]
{{- if .Values.workerNetworkPolicy.enabled }}
# Per job, NetworkPolicy <job>-workers (workerNetworkPolicy), owned by the TrainingJob: the garbage collector
# deletes it. get: who owns one whose name a create found taken.
- apiGroups: ["networking.k8s.io"]
  resources: ["networkpolicies"]
  verbs: ["get", "create"]
{{- end }}
{{- if .Values.rbac.gangScheduling }}
- apiGroups: ["scheduling.x-k8s.io", "scheduling.volcano.sh"]
  resources: ["podgroups"]
  verbs: ["get", "create", "update"]
- apiGroups: ["scheduling.k8s.io"]
  resources: ["podgroups"]
  verbs: ["get", "create"]
{{- end }}
{{- if .Values.rbac.kueue }}
# Kueue: one Workload per job with spec.scheduling.queue (owned by the job), deactivated while the job
# is suspended (patch: spec.active); its status is written when the evicted gang is gone (quota given
# back) and when the job finishes.
- apiGroups: ["kueue.x-k8s.io"]
  resources: ["workloads"]
  verbs: ["get", "list", "watch", "create", "delete", "patch"]
- apiGroups: ["kueue.x-k8s.io"]
  resources: ["workloads/status"]
  verbs: ["patch"]
{{- end }}
{{- end }}
