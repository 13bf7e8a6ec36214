{{/* Names: every workload is <release>-<role> (`infermesh scale --kubernetes` patches these). */}}
{{- define "infermesh.name" -}}
{{ .root.Release.Name }}-{{ .role }}
{{- end }}

{{- define "infermesh.selector" -}}
app.kubernetes.io/name: infermesh
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .role }}
{{- end }}

{{- define "infermesh.labels" -}}
{{ include "infermesh.selector" . }}
app.kubernetes.io/version: {{ .root.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .root.Release.Service }}
helm.sh/chart: {{ .root.Chart.Name }}-{{ .root.Chart.Version }}
{{- end }}

{{- define "infermesh.image" -}}
{{ .Values.image.repository }}:{{ .Values.image.tag }}
{{- end }}

{{- define "infermesh.registryUrl" -}}
{{- if .Values.registry.redis.enabled -}}
redis://{{ .Release.Name }}-redis:6379/0
{{- else -}}
{{- required "registry.externalUrl (redis://HOST:PORT) is needed when registry.redis.enabled is false" .Values.registry.externalUrl -}}
{{- end -}}
{{- end }}

{{/* What every process is told: its address, the model, the registry, metrics and tracing. */}}
{{- define "infermesh.commonArgs" -}}
- --host=$(POD_IP)
- --bind-host=0.0.0.0
- --model={{ .Values.model.name }}
- --registry={{ include "infermesh.registryUrl" . }}
- --metrics-port={{ .Values.metrics.port }}
- --drain-timeout-s={{ .Values.drainTimeoutSeconds }}
{{- if .Values.tls.secret }}
- --health-port={{ .Values.ports.health }}
{{- end }}
{{- if .Values.tracing.otlpEndpoint }}
- --trace=otlp
- --metrics=otlp
{{- end }}
{{- end }}

{{- define "infermesh.env" -}}
- name: POD_IP
  valueFrom:
    fieldRef:
      fieldPath: status.podIP
{{- if .Values.tracing.otlpEndpoint }}
- name: OTEL_EXPORTER_OTLP_ENDPOINT
  value: {{ .Values.tracing.otlpEndpoint | quote }}
{{- end }}
{{- with .Values.adminTokenSecret }}
- name: INFERMESH_ADMIN_TOKEN
  valueFrom:
    secretKeyRef:
      name: {{ . }}
      key: token
{{- end }}
{{- if .Values.tls.secret }}
- name: INFERMESH_TLS_CA
  value: /etc/infermesh/tls/ca.crt
- name: INFERMESH_TLS_CERT
  value: /etc/infermesh/tls/tls.crt
- name: INFERMESH_TLS_KEY
  value: /etc/infermesh/tls/tls.key
- name: INFERMESH_TLS_SERVER_NAME
  value: {{ required "tls.serverName (the name the certificate carries: pods are dialled by IP) is needed with tls.secret" .Values.tls.serverName | quote }}
{{- end }}
{{- end }}

{{/* TLS: the Secret (ca.crt, tls.crt, tls.key: cert-manager's shape) read-only at /etc/infermesh/tls. */}}
{{- define "infermesh.tlsVolume" -}}
{{- if .Values.tls.secret }}
- name: tls
  secret:
    secretName: {{ .Values.tls.secret }}
{{- end }}
{{- end }}

{{- define "infermesh.tlsMount" -}}
{{- if .Values.tls.secret }}
- name: tls
  mountPath: /etc/infermesh/tls
  readOnly: true
{{- end }}
{{- end }}

{{/* Probes dial the service port, or with TLS on the plaintext port that serves health alone (the kubelet's
gRPC probes speak no TLS). */}}
{{- define "infermesh.probePort" -}}
{{ ternary .Values.ports.health .Values.ports.grpc (not (empty .Values.tls.secret)) }}
{{- end }}

{{/* Volumes: /dev/shm in memory, and the model from its source. */}}
{{- define "infermesh.volumes" -}}
- name: dshm
  emptyDir:
    medium: Memory
    sizeLimit: {{ .Values.shmSizeLimit }}
{{- include "infermesh.tlsVolume" . }}
{{- $source := .Values.model.source }}
{{- if eq $source.type "pvc" }}
- name: model
  persistentVolumeClaim:
    claimName: {{ required "model.source.pvc.claimName is needed for a pvc source" $source.pvc.claimName }}
    readOnly: {{ not .Values.model.fetch.enabled }}
{{- else if eq $source.type "hostPath" }}
- name: model
  hostPath:
    path: {{ required "model.source.hostPath.path is needed for a hostPath source" $source.hostPath.path }}
    type: Directory
{{- else if or (eq $source.type "image") .Values.model.fetch.enabled }}
- name: model
  emptyDir: {}
{{- end }}
{{- end }}

{{- define "infermesh.volumeMounts" -}}
- name: dshm
  mountPath: /dev/shm
{{- include "infermesh.tlsMount" . }}
{{- if or (ne .Values.model.source.type "none") .Values.model.fetch.enabled }}
- name: model
  mountPath: {{ .Values.model.mountPath }}
{{- end }}
{{- end }}

{{- define "infermesh.initContainers" -}}
{{- $source := .Values.model.source }}
{{- if eq $source.type "image" }}
- name: copy-model
  image: {{ required "model.source.image.repository is needed for an image source" $source.image.repository }}:{{ $source.image.tag }}
  command: ["sh", "-c", "cp -r {{ $source.image.path }}/. {{ .Values.model.mountPath }}/"]
  volumeMounts:
    - name: model
      mountPath: {{ .Values.model.mountPath }}
{{- end }}
{{- if .Values.model.fetch.enabled }}
- name: fetch-model
  image: {{ .Values.model.fetch.image }}
  command: {{ required "model.fetch.command is needed when model.fetch.enabled" .Values.model.fetch.command | toJson }}
  volumeMounts:
    - name: model
      mountPath: {{ .Values.model.mountPath }}
{{- end }}
{{- end }}

{{/* Probes through grpc.health.v1: started and ready when it serves (""), live unless its engine failed. */}}
{{- define "infermesh.probes" -}}
startupProbe:
  grpc:
    port: {{ include "infermesh.probePort" . }}
  periodSeconds: {{ .Values.probes.startup.periodSeconds }}
  failureThreshold: {{ .Values.probes.startup.failureThreshold }}
readinessProbe:
  grpc:
    port: {{ include "infermesh.probePort" . }}
  periodSeconds: {{ .Values.probes.readiness.periodSeconds }}
livenessProbe:
  grpc:
    port: {{ include "infermesh.probePort" . }}
    service: liveness
  periodSeconds: {{ .Values.probes.liveness.periodSeconds }}
  failureThreshold: {{ .Values.probes.liveness.failureThreshold }}
lifecycle:
  preStop:
    exec:
      command: ["sh", "-c", "infermesh drain --address $POD_IP:{{ .Values.ports.grpc }} --wait"]
{{- end }}

{{- define "infermesh.podExtras" -}}
{{- with .values.nodeSelector }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .values.tolerations }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .values.affinity }}
affinity:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .root.Values.imagePullSecrets }}
imagePullSecrets:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end }}

{{/* Rank 0 of an instance: the service, its ranks and where they meet, its probes and drain on stop. */}}
{{- define "infermesh.rank0" -}}
- name: {{ .r.role }}
  image: {{ include "infermesh.image" .root }}
  imagePullPolicy: {{ .root.Values.image.pullPolicy }}
  command: ["python", "-m", "{{ .r.module }}"]
  args:
    {{- include "infermesh.commonArgs" .root | nindent 4 }}
    - --port={{ .root.Values.ports.grpc }}
    - --{{ .r.flag }}={{ .ranks }}
    - --dtype={{ .root.Values.model.dtype }}
    - --rendezvous-port={{ .root.Values.ports.rendezvous }}
    - --local-ranks={{ .perPod }}
    {{- if ne .r.role "expert" }}
    - --device={{ .root.Values.model.device }}
    - --quantization={{ .root.Values.model.quantization }}
    - --batch-invariant={{ .root.Values.model.batchInvariant }}
    - --kv-cache-bytes={{ int64 .v.kvCacheBytes }}
    - --mooncake-protocol={{ .root.Values.mooncake.protocol }}
    {{- with .root.Values.mooncake.devices }}
    - --mooncake-devices={{ . }}
    {{- end }}
    {{- if and .root.Values.kvPool.enabled (eq (int .ranks) 1) }}
    - --kv-pool=mooncake://{{ .root.Release.Name }}-kv-pool:{{ .root.Values.kvPool.port }}
    {{- end }}
    {{- if gt (int .root.Values.expert.replicas) 0 }}
    - --experts={{ .root.Release.Name }}-expert:{{ .root.Values.ports.grpc }}
    {{- end }}
    {{- end }}
    {{- if eq .r.role "prefill" }}
    - --cp-method={{ .v.cpMethod }}
    {{- end }}
  env:
    {{- include "infermesh.env" .root | nindent 4 }}
  ports:
    - {name: grpc, containerPort: {{ .root.Values.ports.grpc }}}
    - {name: metrics, containerPort: {{ .root.Values.metrics.port }}}
    {{- if .root.Values.tls.secret }}
    - {name: health, containerPort: {{ .root.Values.ports.health }}}
    {{- end }}
    - {name: rendezvous, containerPort: {{ .root.Values.ports.rendezvous }}}
  resources:
    {{- toYaml .resources | nindent 4 }}
  volumeMounts:
    {{- include "infermesh.volumeMounts" .root | nindent 4 }}
  {{- include "infermesh.probes" .root | nindent 2 }}
{{- end }}
