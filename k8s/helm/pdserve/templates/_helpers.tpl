{{/* Names, labels and the rendered pdserve config. */}}

{{- define "pdserve.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Kept to 40 characters: KubeRay derives pod and Service names from the RayCluster's. */}}
{{- define "pdserve.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 40 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 40 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 40 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "pdserve.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "pdserve.selectorLabels" -}}
app.kubernetes.io/name: {{ include "pdserve.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "pdserve.labels" -}}
helm.sh/chart: {{ include "pdserve.chart" . }}
{{ include "pdserve.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: pdserve
{{- end }}

{{/* Every pod of this release's Ray cluster (head, prefill, decode) carries this label. */}}
{{- define "pdserve.rayPodLabel" -}}
pdserve.io/ray-cluster: {{ include "pdserve.fullname" . }}
{{- end }}

{{- define "pdserve.image" -}}
{{ .Values.image.repository }}:{{ .Values.image.tag }}
{{- end }}

{{- define "pdserve.rayAuthSecret" -}}
{{- default (printf "%s-ray-auth" (include "pdserve.fullname" .)) .Values.rayAuth.existingSecret }}
{{- end }}

{{/* The Secret holding the Redis password, or "" when the Redis in use has none. */}}
{{- define "pdserve.redisSecret" -}}
{{- if .Values.redis.existingSecret }}
{{- .Values.redis.existingSecret }}
{{- else if .Values.redis.enabled }}
{{- printf "%s-redis" (include "pdserve.fullname" .) }}
{{- end }}
{{- end }}

{{- define "pdserve.redisSecretKey" -}}
{{- if .Values.redis.existingSecret }}{{ .Values.redis.existingSecretKey }}{{ else }}redis-password{{ end }}
{{- end }}

{{/* The Redis URL without a password (the router adds it from the Secret), or "". */}}
{{- define "pdserve.redisUrl" -}}
{{- if .Values.redis.enabled }}
{{- printf "redis://%s-redis.%s.svc:6379/0" (include "pdserve.fullname" .) .Release.Namespace }}
{{- else if .Values.redis.url }}
{{- if regexMatch "^rediss?://[^/@]*:[^/@]*@" .Values.redis.url }}
{{- fail "redis.url must not hold a password: put it in a Secret and name it in redis.existingSecret" }}
{{- end }}
{{- .Values.redis.url }}
{{- end }}
{{- end }}

{{/* The Secret holding the router's API key, or "" when apiKey.enabled is off. */}}
{{- define "pdserve.apiKeySecret" -}}
{{- with .Values.router.apiKey }}
{{- if .enabled }}
{{- default (printf "%s-api-key" (include "pdserve.fullname" $)) .existingSecret }}
{{- end }}
{{- end }}
{{- end }}

{{- define "pdserve.apiKeySecretKey" -}}
{{- if .Values.router.apiKey.existingSecret }}{{ .Values.router.apiKey.key }}{{ else }}api-key{{ end }}
{{- end }}

{{/* The Secret holding the KV transfer shared secret, or "" when sharedSecret.enabled is off. */}}
{{- define "pdserve.kvSecret" -}}
{{- with .Values.kvTransfer.sharedSecret }}
{{- if .enabled }}
{{- default (printf "%s-kv" (include "pdserve.fullname" $)) .existingSecret }}
{{- end }}
{{- end }}
{{- end }}

{{- define "pdserve.kvSecretKey" -}}
{{- with .Values.kvTransfer.sharedSecret }}{{ if .existingSecret }}{{ .key }}{{ else }}kv-secret{{ end }}{{ end }}
{{- end }}

{{/* The KV transfer shared secret for a worker container, or nothing when it is off. */}}
{{- define "pdserve.kvSecretEnv" -}}
{{- with include "pdserve.kvSecret" . }}
- name: PDSERVE_KV_SECRET
  valueFrom:
    secretKeyRef:
      name: {{ . }}
      key: {{ include "pdserve.kvSecretKey" $ }}
{{- end }}
{{- end }}

{{/* The router's API key, or nothing when it is off. */}}
{{- define "pdserve.apiKeyEnv" -}}
{{- with include "pdserve.apiKeySecret" . }}
- name: PDSERVE_API_KEY
  valueFrom:
    secretKeyRef:
      name: {{ . }}
      key: {{ include "pdserve.apiKeySecretKey" $ }}
{{- end }}
{{- end }}

{{/* Ray token auth for a container: mode and token from the Secret. */}}
{{- define "pdserve.rayAuthEnv" -}}
- name: RAY_AUTH_MODE
  value: token
- name: RAY_AUTH_TOKEN
  valueFrom:
    secretKeyRef:
      name: {{ include "pdserve.rayAuthSecret" . }}
      key: auth-token
{{- end }}

{{/*
TLS on the router's two ports: where the Secrets are mounted in the router container. Empty
when tls.enabled is off; refuses a half-configured tls.* block.
*/}}
{{- define "pdserve.tlsDir" -}}
{{- if .Values.tls.enabled }}
{{- if not .Values.tls.secretName }}
{{- fail "tls.enabled needs tls.secretName: a kubernetes.io/tls Secret (tls.crt, tls.key)" }}
{{- end }}
{{- print "/etc/pdserve-tls" }}
{{- else if .Values.tls.clientCA }}
{{- fail "tls.clientCA (mTLS) needs tls.enabled and tls.secretName" }}
{{- end }}
{{- end }}

{{/* Where the client CA bundle (ca.crt of the tls.clientCA Secret) is mounted, or "". */}}
{{- define "pdserve.clientCADir" -}}
{{- if and (include "pdserve.tlsDir" .) .Values.tls.clientCA }}/etc/pdserve-client-ca{{ end }}
{{- end }}

{{/* 1 when the pools run on GPUs, 0 on CPU; mixing is refused (model.device is one key). */}}
{{- define "pdserve.onGpu" -}}
{{- $p := .Values.prefill.gpusPerWorker | float64 }}
{{- $d := .Values.decode.gpusPerWorker | float64 }}
{{- if and (gt $p 0.0) (eq $d 0.0) (gt (int .Values.decode.replicas) 0) }}
{{- fail "prefill.gpusPerWorker > 0 with decode.gpusPerWorker 0: both pools run on one device kind (model.device)" }}
{{- end }}
{{- if and (gt $d 0.0) (eq $p 0.0) (gt (int .Values.prefill.replicas) 0) }}
{{- fail "decode.gpusPerWorker > 0 with prefill.gpusPerWorker 0: both pools run on one device kind (model.device)" }}
{{- end }}
{{- if or (gt $p 0.0) (gt $d 0.0) }}1{{ else }}0{{ end }}
{{- end }}

{{/* Custom Ray resources of a worker group: pdserve_<role>: 1 plus rayResources. */}}
{{- define "pdserve.groupRayResources" -}}
{{- $pool := index .root.Values .role }}
{{- toJson (merge (dict (printf "pdserve_%s" .role) 1) $pool.rayResources) }}
{{- end }}

{{/*
The pdserve config file: values.config with the keys the chart owns filled in. The actor of
each pool asks for one unit of its group's custom resource, and each Ray worker pod of the
group offers exactly one, so every pod runs one actor.
*/}}
{{- define "pdserve.serveConfig" -}}
{{- $cfg := deepCopy .Values.config }}
{{- $owned := dict
  "prefill" (list "num_workers" "num_gpus" "resources")
  "decode" (list "num_workers" "num_gpus" "resources")
  "router" (list "host" "grpc_port" "http_port" "tls_cert" "tls_key" "tls_client_ca" "api_key")
  "ray" (list "address")
  "transfer" (list "shared_secret")
  "index" (list "redis_url")
  "model" (list "device") }}
{{- range $section, $keys := $owned }}
{{- $given := index $cfg $section | default dict }}
{{- range $keys }}
{{- if hasKey $given . }}
{{- fail (printf "config.%s.%s is set by the chart: use the chart's own values (k8s/README.md)" $section .) }}
{{- end }}
{{- end }}
{{- end }}
{{- range $role := list "prefill" "decode" }}
{{- $pool := index $.Values $role }}
{{- $section := index $cfg $role | default dict }}
{{- $_ := set $section "num_workers" (int $pool.replicas) }}
{{- $_ := set $section "num_gpus" $pool.gpusPerWorker }}
{{- $_ := set $section "resources" (dict (printf "pdserve_%s" $role) 1) }}
{{- $_ := set $cfg $role $section }}
{{- end }}
{{- $model := index $cfg "model" | default dict }}
{{- $_ := set $model "device" (ternary "cuda" "cpu" (eq (include "pdserve.onGpu" .) "1")) }}
{{- $_ := set $cfg "model" $model }}
{{- $router := index $cfg "router" | default dict }}
{{- $_ := set $router "host" "0.0.0.0" }}
{{- $_ := set $router "grpc_port" (int .Values.router.grpcPort) }}
{{- $_ := set $router "http_port" (int .Values.router.httpPort) }}
{{- with include "pdserve.tlsDir" . }}
{{- $_ := set $router "tls_cert" (printf "%s/tls.crt" .) }}
{{- $_ := set $router "tls_key" (printf "%s/tls.key" .) }}
{{- end }}
{{- with include "pdserve.clientCADir" . }}
{{- $_ := set $router "tls_client_ca" (printf "%s/ca.crt" .) }}
{{- end }}
{{- $_ := set $cfg "router" $router }}
{{- $ray := index $cfg "ray" | default dict }}
{{- $_ := set $ray "address" "auto" }}
{{- $_ := set $cfg "ray" $ray }}
{{- toYaml $cfg }}
{{- end }}
