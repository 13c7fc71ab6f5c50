{{/* Names: <release>-kvdepot unless the release name already says kvdepot. */}}
{{- define "kvdepot.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 53 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 53 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "kvdepot.selectorLabels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "kvdepot.labels" -}}
{{ include "kvdepot.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: kvdepot
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{- define "kvdepot.image" -}}
{{- $tag := .Values.image.tag | default .Chart.AppVersion -}}
{{- if and .Values.gpu.enabled (not .Values.image.tag) -}}
{{- $tag = printf "%s-cuda" $tag -}}
{{- end -}}
{{- printf "%s:%s" .Values.image.repository $tag -}}
{{- end -}}

{{/* The CLI health check over TLS, as the probes run it. */}}
{{- define "kvdepot.healthCommand" -}}
["kvdepot", "--addr", "localhost:{{ .Values.service.grpcPort }}", "--tls-ca", "/etc/kvdepot/secrets/ca.crt", "--deadline-ms", "3000", "health"]
{{- end -}}
