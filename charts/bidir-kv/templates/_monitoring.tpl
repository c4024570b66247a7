{{/*
Label matchers that keep the alerts to the namespaces this release watches, with a
trailing comma (PromQL allows one): "" when it watches all of them.
*/}}
{{- define "bidir-kv.alertNamespaces" -}}
{{- with .Values.watchNamespaces }}namespace=~{{ join "|" . | quote }},{{ end }}
{{- end }}

{{/*
An alert's runbook: its section of the chart README, by the anchor of its heading.
Arguments: (list $ "AlertName").
*/}}
{{- define "bidir-kv.runbook" -}}
{{- $root := index . 0 -}}
{{- $anchor := index . 1 | lower -}}
{{- with $root.Values.prometheusRule.runbookBaseUrl -}}
runbook_url: {{ printf "%s#%s" . $anchor | quote }}
{{- else -}}
runbook: {{ printf "charts/bidir-kv/README.md#%s (bidir-kv chart %s)" $anchor $root.Chart.Version | quote }}
{{- end -}}
{{- end }}

{{/* The labels of every alert: its severity, then prometheusRule.alertLabels. */}}
{{- define "bidir-kv.alertLabels" -}}
{{- $root := index . 0 -}}
severity: {{ index . 1 | quote }}
{{- with $root.Values.prometheusRule.alertLabels }}
{{ toYaml . }}
{{- end }}
{{- end }}
