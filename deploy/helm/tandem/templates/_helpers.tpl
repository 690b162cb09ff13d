{{/* Names and labels, in Helm's usual shape. */}}
{{- define "tandem.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "tandem.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else if contains (include "tandem.name" .) .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name (include "tandem.name" .) | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}

{{- define "tandem.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "tandem.selectorLabels" -}}
app.kubernetes.io/name: {{ include "tandem.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "tandem.labels" -}}
helm.sh/chart: {{ include "tandem.chart" . }}
{{ include "tandem.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{- define "tandem.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}

{{- define "tandem.secretName" -}}
{{- default (printf "%s-secrets" (include "tandem.fullname" .)) .Values.secrets.existingSecret }}
{{- end }}

{{/* The model's directory inside every pod. */}}
{{- define "tandem.modelDir" -}}
{{- if eq .Values.model.source "builtin" }}{{- else }}{{ .Values.model.mountPath }}{{ end }}
{{- end }}

{{/* Volumes every tandem pod mounts: the model (if any) and the rendered config. */}}
{{- define "tandem.volumes" -}}
- name: config
  configMap:
    name: {{ include "tandem.fullname" . }}-config
{{- with .Values.clusterTLS.secretName }}
- name: cluster-tls
  secret:
    secretName: {{ . }}
{{- end }}
{{- if eq .Values.model.source "pvc" }}
- name: model
  persistentVolumeClaim:
    claimName: {{ required "model.pvc.claimName is required when model.source is pvc" .Values.model.pvc.claimName }}
    readOnly: true
{{- else if eq .Values.model.source "hostPath" }}
- name: model
  hostPath:
    path: {{ required "model.hostPath.path is required when model.source is hostPath" .Values.model.hostPath.path }}
    type: Directory
{{- else if eq .Values.model.source "huggingface" }}
- name: model  # filled once by the download Job (templates/model-download.yaml)
  persistentVolumeClaim:
    claimName: {{ include "tandem.fullname" . }}-model
    readOnly: true
{{- end }}
{{- end }}

{{- define "tandem.volumeMounts" -}}
- name: config
  mountPath: /etc/tandem
  readOnly: true
{{- if .Values.clusterTLS.secretName }}
- name: cluster-tls
  mountPath: /etc/tandem-cluster-tls
  readOnly: true
{{- end }}
{{- if ne .Values.model.source "builtin" }}
- name: model
  mountPath: {{ .Values.model.mountPath }}
  {{- if eq .Values.model.source "pvc" }}
  {{- with .Values.model.pvc.subPath }}
  subPath: {{ . }}
  {{- end }}
  {{- end }}
  readOnly: true
{{- end }}
{{- end }}

{{/* model.source huggingface: the download's marker file, named after what it fetched, so a
new repo or revision is waited for again (templates/model-download.yaml writes it). */}}
{{- define "tandem.modelMarker" -}}
{{- printf "%s/.tandem-download-%s" .Values.model.mountPath (include "tandem.modelHash" .) }}
{{- end }}

{{- define "tandem.modelHash" -}}
{{- printf "%s@%s" .Values.model.huggingface.repo .Values.model.huggingface.revision | sha256sum | trunc 10 }}
{{- end }}

{{/* Pods wait (bounded) for the model download Job to finish filling the shared volume. */}}
{{- define "tandem.modelInit" -}}
{{- if eq .Values.model.source "huggingface" }}
- name: wait-for-model
  image: {{ include "tandem.image" . }}
  imagePullPolicy: {{ .Values.image.pullPolicy }}
  command: ["/bin/bash", "-c"]
  args:
    - |
      for i in $(seq 1 8640); do  # 12 hours at most: a large checkpoint on a slow link
        [ -f {{ include "tandem.modelMarker" . | quote }} ] && exit 0
        sleep 5
      done
      echo "the model download Job did not finish: kubectl logs job/{{ include "tandem.fullname" . }}-model-{{ include "tandem.modelHash" . }}" >&2
      exit 1
  volumeMounts:
    - name: model
      mountPath: {{ .Values.model.mountPath }}
      readOnly: true
  securityContext:
    {{- toYaml $.Values.securityContext | nindent 4 }}
{{- end }}
{{- end }}

{{/* Ray's token (KubeRay's authOptions names our Secret; containers it does not manage get it here). */}}
{{- define "tandem.rayAuthEnv" -}}
- name: RAY_AUTH_MODE
  value: token
- name: RAY_AUTH_TOKEN
  valueFrom:
    secretKeyRef:
      name: {{ include "tandem.secretName" . }}
      key: auth_token
{{- end }}

{{/* the cluster TLS flags (the Secret mounted at the same path on every pod) */}}
{{- define "tandem.clusterTLSConfig" -}}
{{- if .Values.clusterTLS.secretName }}
cluster-tls-cert: /etc/tandem-cluster-tls/tls.crt
cluster-tls-key: /etc/tandem-cluster-tls/tls.key
cluster-tls-ca: /etc/tandem-cluster-tls/ca.crt
cluster-tls-server-name: {{ .Values.clusterTLS.serverName | quote }}
{{- end }}
{{- end }}

{{/* Ray's processes (worker actors included) log to the container's stderr: `kubectl logs`. */}}
{{- define "tandem.rayLogEnv" -}}
{{- if .Values.logging.toStderr }}
- name: RAY_LOG_TO_STDERR
  value: "1"
{{- end }}
{{- end }}
