{{/* Chart name. */}}
{{- define "bidir-kv.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 50 | trimSuffix "-" }}
{{- end }}

{{/* Full name; at most 50 characters so that suffixes such as -crd-upgrade fit in 63. */}}
{{- define "bidir-kv.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 50 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 50 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 50 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "bidir-kv.selectorLabels" -}}
app.kubernetes.io/name: {{ include "bidir-kv.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "bidir-kv.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{ include "bidir-kv.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{- define "bidir-kv.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "bidir-kv.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- required "serviceAccount.name is required when serviceAccount.create is false" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{- define "bidir-kv.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}

{{/* More than one replica: kopf peering (one active replica, the others on standby). */}}
{{- define "bidir-kv.peering" -}}
{{- if gt (int .Values.replicaCount) 1 }}true{{ end }}
{{- end }}

{{- define "bidir-kv.peeringName" -}}
{{- default (include "bidir-kv.fullname" .) .Values.peering.name }}
{{- end }}

{{/* The CRD this chart ships in crds/ (and `bidir-kv crd --apply` upgrades). */}}
{{- define "bidir-kv.crdName" -}}
disaggregatedinferences.bidirkv.io
{{- end }}

{{/* `bidir-kv operator` arguments. */}}
{{- define "bidir-kv.operatorArgs" -}}
- --liveness
- {{ printf "http://0.0.0.0:%d/healthz" (int .Values.livenessProbe.port) | quote }}
{{- range .Values.watchNamespaces }}
- --namespace
- {{ . | quote }}
{{- end }}
{{- if include "bidir-kv.peering" . }}
- --peering
- {{ include "bidir-kv.peeringName" . | quote }}
- --priority
- auto
{{- end }}
{{- if .Values.verbose }}
- --verbose
{{- end }}
{{- end }}

{{/*
Rules of the operator in the namespaces it watches (a ClusterRole when it watches all).
Every verb here is one the operator uses; e2e/test_chart_install.py compares them with
the requests of a real operator run.
*/}}
{{- define "bidir-kv.operatorRules" -}}
# DisaggregatedInference: kopf lists and watches them; the controller writes /status,
# and gets one afresh before it creates its handle-key Secret (the cached one may predate
# the status that records it).
- apiGroups: ["bidirkv.io"]
  resources: ["disaggregatedinferences"]
  verbs: ["get", "list", "watch"]
- apiGroups: ["bidirkv.io"]
  resources: ["disaggregatedinferences/status"]
  verbs: ["patch"]
# Children: watched (cache), read before a write, created, replaced when they drift.
# Not deleted by the operator: owner references leave that to the garbage collector.
# An autoscaler owns the replicas of an autoscaled role: the operator writes the
# StatefulSet without them (and keeps the live count on a replace).
- apiGroups: ["apps"]
  resources: ["statefulsets", "deployments"]
  verbs: ["get", "list", "watch", "create", "update"]
- apiGroups: [""]
  resources: ["services", "configmaps"]
  verbs: ["get", "list", "watch", "create", "update"]
- apiGroups: ["policy"]
  resources: ["poddisruptionbudgets"]
  verbs: ["get", "list", "watch", "create", "update"]
- apiGroups: ["networking.k8s.io"]
  resources: ["networkpolicies"]
  verbs: ["get", "list", "watch", "create", "update"]
# The engines' PodMonitor (spec.monitoring.podMonitor): not watched; read before a write,
# and deleted by the operator when the spec turns it off.
- apiGroups: ["monitoring.coreos.com"]
  resources: ["podmonitors"]
  verbs: ["get", "create", "update", "delete"]
# Autoscalers of autoscaled roles (spec.prefill/decode.autoscaling): an autoscaling/v2
# HorizontalPodAutoscaler, or a KEDA ScaledObject with engine keda. Not watched; read
# before a write, and deleted by the operator when autoscaling is turned off or the
# engine changes.
- apiGroups: ["autoscaling"]
  resources: ["horizontalpodautoscalers"]
  verbs: ["get", "create", "update", "delete"]
- apiGroups: ["keda.sh"]
  resources: ["scaledobjects"]
  verbs: ["get", "create", "update", "delete"]
# The handle-key Secret of each resource: created once, and recorded (name and uid) in
# the resource's status, which is all the operator and the pods go by. Create alone: no
# Secret is ever read, listed, watched or changed, and one the operator did not see
# itself create (a 409) is never used (docs/operator.md, Isolation).
- apiGroups: [""]
  resources: ["secrets"]
  verbs: ["create"]
# Engine pods, watched and listed by label: a pod being deleted drains, and the status
# says which do and until when (only their metadata, spec and pod IP are read: a draining
# decode pod's engine is asked how many conversations it still holds).
- apiGroups: [""]
  resources: ["pods"]
  verbs: ["list", "watch"]
# Warning events for specs the operator cannot apply (InvalidSpec, ChildConflict) and
# engine pods whose drain ran out (DrainTimedOut).
- apiGroups: [""]
  resources: ["events"]
  verbs: ["create"]
{{- end }}

{{/* kopf peering, when more than one replica runs. $kind: kopfpeerings or clusterkopfpeerings. */}}
{{- define "bidir-kv.peeringRules" -}}
{{- $root := index . 0 }}
{{- $resource := index . 1 -}}
# kopf observes the peering object (list, watch) and renews its lease in it (patch); the
# operator creates it at start-up when missing (get, create: create cannot be limited to
# a name).
- apiGroups: ["kopf.dev"]
  resources: [{{ $resource | quote }}]
  verbs: ["list", "watch", "create"]
- apiGroups: ["kopf.dev"]
  resources: [{{ $resource | quote }}]
  resourceNames: [{{ include "bidir-kv.peeringName" $root | quote }}]
  verbs: ["get", "patch"]
{{- end }}

{{- define "bidir-kv.podSecurityContext" -}}
runAsNonRoot: true
runAsUser: 65532
runAsGroup: 65532
seccompProfile:
  type: RuntimeDefault
{{- end }}

{{- define "bidir-kv.containerSecurityContext" -}}
runAsNonRoot: true
runAsUser: 65532
runAsGroup: 65532
allowPrivilegeEscalation: false
readOnlyRootFilesystem: true
privileged: false
capabilities:
  drop: ["ALL"]
seccompProfile:
  type: RuntimeDefault
{{- end }}

{{- define "bidir-kv.scheduling" -}}
{{- with .Values.nodeSelector }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .Values.tolerations }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .Values.imagePullSecrets }}
imagePullSecrets:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end }}
