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
- name: model
  emptyDir: {}
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
  readOnly: {{ ne .Values.model.source "huggingface" }}
{{- end }}
{{- end }}

{{/* The init container that downloads the model from a Hugging Face repo (model.source huggingface). */}}
{{- define "tandem.modelInit" -}}
{{- if eq .Values.model.source "huggingface" }}
- name: fetch-model
  image: {{ include "tandem.image" . }}
  imagePullPolicy: {{ .Values.image.pullPolicy }}
  command: ["python3", "-c"]
  args:
    - |
      import os
      from huggingface_hub import snapshot_download
      snapshot_download(os.environ["HF_REPO"], revision=os.environ["HF_REVISION"],
                        local_dir=os.environ["MODEL_DIR"], token=os.environ.get("HF_TOKEN") or None)
  env:
    - name: HF_REPO
      value: {{ required "model.huggingface.repo is required when model.source is huggingface" .Values.model.huggingface.repo | quote }}
    - name: HF_REVISION
      value: {{ .Values.model.huggingface.revision | quote }}
    - name: MODEL_DIR
      value: {{ .Values.model.mountPath | quote }}
    {{- with .Values.model.huggingface.tokenSecret }}
    {{- if .name }}
    - name: HF_TOKEN
      valueFrom:
        secretKeyRef:
          name: {{ .name }}
          key: {{ .key }}
    {{- end }}
    {{- end }}
  volumeMounts:
    - name: model
      mountPath: {{ .Values.model.mountPath }}
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
