{{/* Names, labels and the pieces every Switchyard container shares. */}}

{{- define "switchyard.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "switchyard.fullname" -}}
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

{{/* Labels on every object; call with (dict "ctx" $ "component" "gateway"). */}}
{{- define "switchyard.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .ctx.Chart.Name .ctx.Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
app.kubernetes.io/managed-by: {{ .ctx.Release.Service }}
app.kubernetes.io/version: {{ .ctx.Chart.AppVersion | quote }}
{{ include "switchyard.selectorLabels" . }}
{{- with .ctx.Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{/* Selector labels; add "pool" for a worker pool. */}}
{{- define "switchyard.selectorLabels" -}}
app.kubernetes.io/name: {{ include "switchyard.name" .ctx }}
app.kubernetes.io/instance: {{ .ctx.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- with .pool }}
switchyard.dev/pool: {{ . }}
{{- end }}
{{- end -}}

{{/* A worker pool's Deployment name; call with (dict "ctx" $ "pool" "prefill"). */}}
{{- define "switchyard.workerName" -}}
{{- printf "%s-worker-%s" (include "switchyard.fullname" .ctx) .pool | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "switchyard.plannerName" -}}
{{- printf "%s-planner" (include "switchyard.fullname" .) | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "switchyard.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "switchyard.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{- define "switchyard.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}

{{- define "switchyard.adminSecretName" -}}
{{- default (printf "%s-admin" (include "switchyard.fullname" .)) .Values.admin.existingSecret -}}
{{- end -}}

{{/* etcd endpoints, comma-separated: the in-chart StatefulSet's Service or the external list. */}}
{{- define "switchyard.etcdEndpoints" -}}
{{- if .Values.etcd.enabled -}}
{{- printf "%s://%s-etcd:2379" (ternary "https" "http" .Values.etcd.tls.enabled) (include "switchyard.fullname" .) -}}
{{- else -}}
{{- if not .Values.etcd.endpoints -}}
{{- fail "etcd.enabled is false, so etcd.endpoints must list at least one external etcd endpoint" -}}
{{- end -}}
{{- join "," .Values.etcd.endpoints -}}
{{- end -}}
{{- end -}}

{{/* Whether the workers register in etcd: etcd discovery, or the planner (which finds and
re-roles workers through etcd). */}}
{{- define "switchyard.workersUseEtcd" -}}
{{- if or (eq .Values.discovery "etcd") .Values.planner.enabled -}}true{{- end -}}
{{- end -}}

{{/* The ServiceAccount of the pods that watch the worker pods (discovery: kubernetes). */}}
{{- define "switchyard.discoveryName" -}}
{{- printf "%s-discovery" (include "switchyard.fullname" .) | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* Pod-level identity of a gateway or endpoint picker pod: the discovery ServiceAccount with
its token when it reads the Kubernetes API, else the shared one without a token. */}}
{{- define "switchyard.discoveryPodIdentity" -}}
{{- if eq .Values.discovery "kubernetes" -}}
serviceAccountName: {{ include "switchyard.discoveryName" . }}
automountServiceAccountToken: true
{{- else -}}
serviceAccountName: {{ include "switchyard.serviceAccountName" . }}
automountServiceAccountToken: false
{{- end -}}
{{- end -}}

{{/* How a gateway finds the workers: etcd, or every worker pod of the release. */}}
{{- define "switchyard.gatewayDiscoveryArgs" -}}
{{- if eq .Values.discovery "kubernetes" -}}
- --discovery=kubernetes
- --k8s-selector=app.kubernetes.io/name={{ include "switchyard.name" . }},app.kubernetes.io/instance={{ .Release.Name }},app.kubernetes.io/component=worker
- --k8s-worker-port=grpc
{{- else -}}
- --etcd={{ include "switchyard.etcdEndpoints" . }}
{{- end -}}
{{- end -}}

{{/* Environment every Switchyard container gets. */}}
{{- define "switchyard.commonEnv" -}}
- name: SWITCHYARD_LOG
  value: {{ .Values.logLevel | quote }}
- name: POD_NAME
  valueFrom:
    fieldRef:
      fieldPath: metadata.name
- name: POD_IP
  valueFrom:
    fieldRef:
      fieldPath: status.podIP
{{- if .Values.otlpEndpoint }}
- name: OTEL_RESOURCE_ATTRIBUTES
  value: "k8s.pod.name=$(POD_NAME),k8s.namespace.name={{ .Release.Namespace }}"
{{- end }}
{{- end -}}

{{/*
A grpc.health.v1 probe on the worker port; call with (dict "port" N "probe" .readinessProbe
"service" "switchyard.v1.Worker"). An empty service asks for the server's overall health.
*/}}
{{- define "switchyard.grpcProbe" -}}
grpc:
  port: {{ .port }}
  {{- with .service }}
  service: {{ . }}
  {{- end }}
{{ toYaml .probe }}
{{- end -}}

{{/* The cluster secret's Secret (docs/security.md). */}}
{{- define "switchyard.clusterSecretName" -}}
{{- default (printf "%s-cluster" (include "switchyard.fullname" .)) .Values.security.clusterSecret.existingSecret -}}
{{- end -}}

{{/* The hashed API key list's Secret. */}}
{{- define "switchyard.apiKeysSecretName" -}}
{{- default (printf "%s-api-keys" (include "switchyard.fullname" .)) .Values.apiKeys.existingSecret -}}
{{- end -}}

{{/* Where the cluster secret is mounted, and the flag that reads it. */}}
{{- define "switchyard.clusterSecretArg" -}}
{{- if .Values.security.clusterSecret.enabled }}
- --cluster-secret-file=/var/run/switchyard/cluster/{{ .Values.security.clusterSecret.secretKey }}
{{- end }}
{{- end -}}

{{- define "switchyard.clusterSecretMount" -}}
{{- if .Values.security.clusterSecret.enabled }}
- name: cluster-secret
  mountPath: /var/run/switchyard/cluster
  readOnly: true
{{- end }}
{{- end -}}

{{- define "switchyard.clusterSecretVolume" -}}
{{- if .Values.security.clusterSecret.enabled }}
- name: cluster-secret
  secret:
    secretName: {{ include "switchyard.clusterSecretName" . }}
    items:
      - key: {{ .Values.security.clusterSecret.secretKey }}
        path: {{ .Values.security.clusterSecret.secretKey }}
{{- end }}
{{- end -}}
