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
  "router" (list "host" "tls" "api_key")
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
{{- $_ := set $model "model" (include "pdserve.modelSpec" .) }}
{{- with .Values.model.revision }}
{{- if ne (include "pdserve.modelKind" $) "hf" }}
{{- fail "model.revision applies to an hf:// model.uri only" }}
{{- end }}
{{- if hasKey $model "revision" }}
{{- fail "config.model.revision and model.revision are both set: give it in model.revision only" }}
{{- end }}
{{- $_ := set $model "revision" . }}
{{- end }}
{{- if .Values.model.chatTemplate }}
{{- if hasKey $model "chat_template" }}
{{- fail "config.model.chat_template and model.chatTemplate are both set: give the template in model.chatTemplate only" }}
{{- end }}
{{- $_ := set $model "chat_template" (include "pdserve.chatTemplatePath" .) }}
{{- end }}
{{- $_ := set $model "device" (ternary "cuda" "cpu" (eq (include "pdserve.onGpu" .) "1")) }}
{{- $_ := set $cfg "model" $model }}
{{- $router := index $cfg "router" | default dict }}
{{- $_ := set $router "host" "0.0.0.0" }}
{{- range $api, $port := dict "grpc" .Values.router.grpcPort "http" .Values.router.httpPort }}
{{- $given := index $router $api | default dict }}
{{- if hasKey $given "port" }}
{{- fail (printf "config.router.%s.port is set by the chart: use the chart's own values (k8s/README.md)" $api) }}
{{- end }}
{{- $_ := set $given "port" (int $port) }}
{{- $_ := set $router $api $given }}
{{- end }}
{{- $tls := dict }}
{{- with include "pdserve.tlsDir" . }}
{{- $_ := set $tls "cert" (printf "%s/tls.crt" .) }}
{{- $_ := set $tls "key" (printf "%s/tls.key" .) }}
{{- end }}
{{- with include "pdserve.clientCADir" . }}
{{- $_ := set $tls "client_ca" (printf "%s/ca.crt" .) }}
{{- end }}
{{- if $tls }}
{{- $_ := set $router "tls" $tls }}
{{- end }}
{{- $_ := set $cfg "router" $router }}
{{- $ray := index $cfg "ray" | default dict }}
{{- $_ := set $ray "address" "auto" }}
{{- $_ := set $cfg "ray" $ray }}
{{- toYaml $cfg }}
{{- end }}

{{/*
The model (model.uri): "" keeps config.model.model (default smollm2-135m-instruct, baked into
the image); a named model baked into the image; hf://org/name, fetched from the Hub into each
pod's cache by an init container; pvc://claim/path, a PVC mounted read-only at the same path
in every pod. pdserve.modelKind is one of "", named, hf, pvc.
*/}}
{{- define "pdserve.modelKind" -}}
{{- $uri := .Values.model.uri }}
{{- if not $uri }}
{{- else if hasPrefix "hf://" $uri }}hf
{{- else if hasPrefix "pvc://" $uri }}pvc
{{- else }}named
{{- end }}
{{- end }}

{{- define "pdserve.pvcMountPath" -}}/mnt/pdserve-model{{- end }}
{{- define "pdserve.hfHome" -}}/var/cache/huggingface{{- end }}
{{- define "pdserve.chatTemplatePath" -}}/etc/pdserve/chat-template.jinja{{- end }}

{{/* The PVC of a pvc:// model.uri. */}}
{{- define "pdserve.pvcClaim" -}}
{{- regexFind "^[^/]+" (trimPrefix "pvc://" .Values.model.uri) }}
{{- end }}

{{/* What config.model.model becomes: the path, name or Hub id that `pdserve serve` resolves. */}}
{{- define "pdserve.modelSpec" -}}
{{- $kind := include "pdserve.modelKind" . }}
{{- $given := dig "model" "model" "" .Values.config }}
{{- if and $kind $given }}
{{- fail "config.model.model and model.uri are both set: give the model in model.uri only" }}
{{- end }}
{{- if eq $kind "hf" }}
{{- trimPrefix "hf://" .Values.model.uri }}
{{- else if eq $kind "pvc" }}
{{- $rest := trimPrefix (include "pdserve.pvcClaim" .) (trimPrefix "pvc://" .Values.model.uri) | trimSuffix "/" }}
{{- if regexMatch "(^|/)\\.\\.?(/|$)" $rest }}
{{- fail "model.uri: a pvc:// path must not contain . or .. segments" }}
{{- end }}
{{- printf "%s%s" (include "pdserve.pvcMountPath" .) $rest }}
{{- else if eq $kind "named" }}
{{- .Values.model.uri }}
{{- else }}
{{- $given | default "smollm2-135m-instruct" }}
{{- end }}
{{- end }}

{{/* Volumes every Ray pod needs for the model and the chat template (head and workers). */}}
{{- define "pdserve.modelVolumes" -}}
{{- $kind := include "pdserve.modelKind" . }}
{{- if eq $kind "pvc" }}
- name: model-pvc
  persistentVolumeClaim:
    claimName: {{ include "pdserve.pvcClaim" . }}
    readOnly: true
{{- else if eq $kind "hf" }}
- name: hf-cache
  {{- if .Values.model.hfCacheVolume }}
  {{- toYaml .Values.model.hfCacheVolume | nindent 2 }}
  {{- else }}
  emptyDir: {}
  {{- end }}
{{- end }}
{{- end }}

{{/* Their mounts, in the router and in every Ray worker container (read-only). */}}
{{- define "pdserve.modelMounts" -}}
{{- $kind := include "pdserve.modelKind" . }}
{{- if eq $kind "pvc" }}
- {name: model-pvc, mountPath: {{ include "pdserve.pvcMountPath" . }}, readOnly: true}
{{- else if eq $kind "hf" }}
- {name: hf-cache, mountPath: {{ include "pdserve.hfHome" . }}, readOnly: true}
{{- end }}
{{- end }}

{{/* Env of the router and worker containers for an hf:// model: the cache the init
container filled, and no network (every pod uses the snapshot it fetched itself). */}}
{{- define "pdserve.modelEnv" -}}
{{- if eq (include "pdserve.modelKind" .) "hf" }}
- name: HF_HOME
  value: {{ include "pdserve.hfHome" . }}
- name: HF_HUB_OFFLINE
  value: "1"
{{- end }}
{{- end }}

{{/*
An hf:// model: an init container per Ray pod (head and workers) downloads the snapshot into
the pod's hf-cache volume with pdserve's own resolver, so the router and every worker find it
at the same path. HF_TOKEN (model.hfTokenSecret) reaches this container only. Needs dict
root, resources.
*/}}
{{- define "pdserve.modelInitContainers" -}}
{{- $root := .root }}
{{- if eq (include "pdserve.modelKind" $root) "hf" }}
- name: fetch-model
  image: {{ include "pdserve.image" $root }}
  imagePullPolicy: {{ $root.Values.image.pullPolicy }}
  command:
    - python3
    - -c
    - |
      import os, sys
      from pdserve.models import require_tokenizer, resolve_model
      path = resolve_model(sys.argv[1], revision=sys.argv[2] or None)
      require_tokenizer(path, sys.argv[1])
      if not str(path).startswith(os.environ["HF_HOME"]):
          sys.exit(f"pdserve: {sys.argv[1]} has no tokenizer.json (converted into {path}, "
                   "which the other pods do not see): use a repository with tokenizer.json, "
                   "or a pvc:// copy of the checkpoint with one")
      print(path)
    - {{ trimPrefix "hf://" $root.Values.model.uri | quote }}
    - {{ $root.Values.model.revision | quote }}
  env:
    - name: HF_HOME
      value: {{ include "pdserve.hfHome" $root }}
    {{- with $root.Values.model.hfTokenSecret }}
    {{- if .name }}
    - name: HF_TOKEN
      valueFrom:
        secretKeyRef:
          name: {{ .name }}
          key: {{ .key }}
    {{- end }}
    {{- end }}
  resources:
    {{- toYaml .resources | nindent 4 }}
  securityContext:
    {{- toYaml $root.Values.securityContext | nindent 4 }}
  volumeMounts:
    - {name: hf-cache, mountPath: {{ include "pdserve.hfHome" $root }}}
{{- end }}
{{- end }}

{{/* Flags of `pdserve serve` the chart sets itself: refused in router.extraArgs, and so are
their abbreviations (argparse takes any unambiguous prefix). */}}
{{- define "pdserve.checkExtraArgs" -}}
{{- $owned := dict
  "config" "the chart's ConfigMap" "ray-address" "the chart (auto)"
  "host" "the chart (0.0.0.0)" "grpc-port" "router.grpcPort" "http-port" "router.httpPort"
  "port" "router.httpPort"
  "no-http" "the readiness probe (HTTP /health)" "model" "model.uri"
  "chat-template" "model.chatTemplate" "prefill-workers" "prefill.replicas"
  "decode-workers" "decode.replicas" "tls-cert" "tls.*" "tls-key" "tls.*"
  "tls-client-ca" "tls.clientCA" "api-key" "router.apiKey (a Secret, by env)"
  "api-key-file" "router.apiKey (a Secret, by env)" "redis-url" "redis.*"
  "redis-password-file" "redis.existingSecret" }}
{{- range .Values.router.extraArgs }}
{{- $flag := regexReplaceAll "=.*$" (toString .) "" | trimPrefix "--" }}
{{- if and (hasPrefix "--" (toString .)) $flag }}
{{- range $name := keys $owned | sortAlpha }}
{{- if hasPrefix $flag $name }}
{{- $as := ternary "" (printf " (--%s)" $name) (eq $flag $name) }}
{{- fail (printf "router.extraArgs: --%s%s is set by the chart: use %s" $flag $as (index $owned $name)) }}
{{- end }}
{{- end }}
{{- end }}
{{- end }}
{{- end }}

{{/* A word for /bin/sh, single-quoted. */}}
{{- define "pdserve.shellQuote" -}}
'{{ replace "'" "'\\''" (toString .) }}'
{{- end }}
