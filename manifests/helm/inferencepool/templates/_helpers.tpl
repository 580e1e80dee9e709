{{/*
Names. The InferencePool is the release's name; the picker's objects are
<release>-epp, the standalone Envoy's <release>-envoy.
*/}}
{{- define "inferencepool.poolName" -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "inferencepool.eppName" -}}
{{- printf "%s-epp" .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "inferencepool.eppHeadlessName" -}}
{{- printf "%s-epp-pods" .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "inferencepool.poolHeadlessName" -}}
{{- printf "%s-pool-pods" .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "inferencepool.envoyName" -}}
{{- printf "%s-envoy" .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "inferencepool.serviceAccountName" -}}
{{- $sa := .Values.inferenceExtension.serviceAccount -}}
{{- if $sa.create -}}
{{- default (include "inferencepool.eppName" .) $sa.name -}}
{{- else -}}
{{- default "default" $sa.name -}}
{{- end -}}
{{- end -}}

{{/* Labels on every object. */}}
{{- define "inferencepool.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: {{ include "inferencepool.poolName" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
{{- end -}}

{{- define "inferencepool.eppSelectorLabels" -}}
app.kubernetes.io/name: envoy-epp
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: endpoint-picker
{{- end -}}

{{- define "inferencepool.envoySelectorLabels" -}}
app.kubernetes.io/name: envoy
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: proxy
{{- end -}}

{{- define "inferencepool.eppImage" -}}
{{- $image := .Values.inferenceExtension.image -}}
{{- $ref := printf "%s:%s" $image.name (default .Chart.AppVersion $image.tag) -}}
{{- if $image.hub -}}
{{- printf "%s/%s" (trimSuffix "/" $image.hub) $ref -}}
{{- else -}}
{{- $ref -}}
{{- end -}}
{{- end -}}

{{/* The InferencePool's API group, from inferencePool.apiVersion. */}}
{{- define "inferencepool.poolGroup" -}}
{{- index (splitList "/" .Values.inferencePool.apiVersion) 0 -}}
{{- end -}}

{{/* The pool's label selector as --endpoint-selector wants it: k=v,k=v (sorted). */}}
{{- define "inferencepool.selectorFlag" -}}
{{- $pairs := list -}}
{{- range $key, $value := .Values.inferencePool.modelServers.matchLabels -}}
{{- $pairs = append $pairs (printf "%s=%s" $key $value) -}}
{{- end -}}
{{- join "," $pairs -}}
{{- end -}}

{{- define "inferencepool.targetPortsFlag" -}}
{{- $ports := list -}}
{{- range .Values.inferencePool.targetPorts -}}
{{- $ports = append $ports (int .number | toString) -}}
{{- end -}}
{{- join "," $ports -}}
{{- end -}}

{{/*
Checks that the schema cannot express; a failed one stops the render with a
message that says what to change.
*/}}
{{- define "inferencepool.validate" -}}
{{- $ie := .Values.inferenceExtension -}}
{{- $pool := .Values.inferencePool -}}
{{- if not $pool.modelServers.matchLabels -}}
{{- fail "inferencePool.modelServers.matchLabels is required: the labels of the model-server pods (e.g. --set inferencePool.modelServers.matchLabels.app=vllm-llama3)" -}}
{{- end -}}
{{- $file := $ie.pluginsConfigFile -}}
{{- if and (ne $file "default-plugins.yaml") (not (hasKey $ie.pluginsCustomConfig $file)) -}}
{{- fail (printf "inferenceExtension.pluginsConfigFile is %q, which is neither default-plugins.yaml nor a key of inferenceExtension.pluginsCustomConfig (%s)" $file (keys $ie.pluginsCustomConfig | sortAlpha | join ", ")) -}}
{{- end -}}
{{- if hasKey $ie.pluginsCustomConfig "default-plugins.yaml" -}}
{{- fail "inferenceExtension.pluginsCustomConfig must not define default-plugins.yaml: that file is built from inferenceExtension.scheduling; give your config another name and select it with pluginsConfigFile" -}}
{{- end -}}
{{- if and (eq (include "inferencepool.poolGroup" .) "inference.networking.x-k8s.io") (gt (len $pool.targetPorts) 1) -}}
{{- fail "inferencePool.apiVersion inference.networking.x-k8s.io/v1alpha2 has a single target port: give one inferencePool.targetPorts entry, or use inference.networking.k8s.io/v1" -}}
{{- end -}}
{{- $tls := $ie.secureServing | default dict -}}
{{- if and (get $tls "certSecretName") (not (get $tls "enabled")) -}}
{{- fail "inferenceExtension.secureServing.certSecretName is only used with inferenceExtension.secureServing.enabled: true (the picker serves plaintext otherwise)" -}}
{{- end -}}
{{- if and (get $ie.kvEvents "replayPort") (not (get $ie.kvEvents "port")) -}}
{{- fail "inferenceExtension.kvEvents.replayPort needs inferenceExtension.kvEvents.port (the engines' KV-event PUB port)" -}}
{{- end -}}
{{- $seen := dict -}}
{{- range $pool.targetPorts -}}
{{- $n := int .number | toString -}}
{{- if hasKey $seen $n -}}
{{- fail (printf "inferencePool.targetPorts lists port %s twice" $n) -}}
{{- end -}}
{{- $_ := set $seen $n true -}}
{{- end -}}
{{- $names := dict -}}
{{- range (include "inferencepool.pluginList" . | fromYamlArray) -}}
{{- $name := default (get . "type") (get . "name") -}}
{{- if hasKey $names $name -}}
{{- fail (printf "plugin name %q is used twice in inferenceExtension.scheduling (each plugin once; give one a different name)" $name) -}}
{{- end -}}
{{- $_ := set $names $name true -}}
{{- end -}}
{{- $detector := $ie.scheduling.saturationDetector -}}
{{- if and $detector (not (hasKey $names $detector)) -}}
{{- fail (printf "inferenceExtension.scheduling.saturationDetector %q names no plugin of inferenceExtension.scheduling.plugins" $detector) -}}
{{- end -}}
{{- $fc := $ie.flowControl | default dict -}}
{{- if get $fc "enabled" -}}
{{- if ne $file "default-plugins.yaml" -}}
{{- fail (printf "inferenceExtension.flowControl.enabled builds default-plugins.yaml, but the picker loads %s (pluginsConfigFile): put featureGates: [flowControl] and a flowControl: section in that file instead, and leave inferenceExtension.flowControl.enabled false" $file) -}}
{{- end -}}
{{- $defaults := list "global-strict-fairness-policy" "fcfs-ordering-policy" "static-usage-limit-policy" -}}
{{- $refs := list (list "usageLimitPolicyPluginRef" (get $fc "usageLimitPolicyPluginRef")) -}}
{{- range $band := list "defaultPriorityBand" "defaultNegativePriorityBand" -}}
{{- $spec := get $fc $band | default dict -}}
{{- range $key := list "fairnessPolicyRef" "orderingPolicyRef" -}}
{{- $refs = append $refs (list (printf "%s.%s" $band $key) (get $spec $key)) -}}
{{- end -}}
{{- end -}}
{{- $priorities := dict -}}
{{- range $i, $spec := (get $fc "priorityBands" | default list) -}}
{{- $p := toString (get $spec "priority") -}}
{{- if hasKey $priorities $p -}}
{{- fail (printf "inferenceExtension.flowControl.priorityBands lists priority %s twice" $p) -}}
{{- end -}}
{{- $_ := set $priorities $p true -}}
{{- range $key := list "fairnessPolicyRef" "orderingPolicyRef" -}}
{{- $refs = append $refs (list (printf "priorityBands[%d].%s" $i $key) (get $spec $key)) -}}
{{- end -}}
{{- end -}}
{{- range $refs -}}
{{- $ref := index . 1 -}}
{{- if and $ref (not (hasKey $names $ref)) (not (has $ref $defaults)) -}}
{{- fail (printf "inferenceExtension.flowControl.%s %q names no plugin of inferenceExtension.scheduling.plugins (declare it there, e.g. {type: %s}; only %s need no declaration)" (index . 0) $ref $ref (join ", " $defaults)) -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- $ttl := include "inferencepool.flowControlTTL" . -}}
{{- if and .Values.envoy.enabled (not .Values.envoy.customConfig) (ne $ttl "") -}}
{{- if eq (float64 $ttl) 0.0 -}}
{{- fail "flow control without a TTL (defaultRequestTTL 0s): a request could wait in the picker longer than any timeout of the standalone Envoy, whose timeouts are derived from the TTL; set defaultRequestTTL (e.g. 60s)" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* Seconds (a number) in a duration: Go's (60s, 1m30s, 500ms) or protobuf's (10s). */}}
{{- define "inferencepool.seconds" -}}
{{- $units := dict "ns" 0.000000001 "us" 0.000001 "µs" 0.000001 "μs" 0.000001 "ms" 0.001 "s" 1.0 "m" 60.0 "h" 3600.0 -}}
{{- $total := 0.0 -}}
{{- range regexFindAll "([0-9]+(\\.[0-9]*)?|\\.[0-9]+)(ns|us|µs|μs|ms|s|m|h)" (toString .) -1 -}}
{{- $number := regexFind "^([0-9]+(\\.[0-9]*)?|\\.[0-9]+)" . -}}
{{- $total = addf $total (mulf (float64 $number) (get $units (trimPrefix $number .))) -}}
{{- end -}}
{{- $total -}}
{{- end -}}

{{/*
The flow-control TTL in seconds of the config the picker loads, or "" when that
config has flow control off: from inferenceExtension.flowControl for
default-plugins.yaml, else from the custom file's featureGates and flowControl.
*/}}
{{- define "inferencepool.flowControlTTL" -}}
{{- $ie := .Values.inferenceExtension -}}
{{- $fc := $ie.flowControl | default dict -}}
{{- if eq $ie.pluginsConfigFile "default-plugins.yaml" -}}
{{- if get $fc "enabled" -}}
{{- include "inferencepool.seconds" (get $fc "defaultRequestTTL" | default "60s") -}}
{{- end -}}
{{- else -}}
{{- $doc := get $ie.pluginsCustomConfig $ie.pluginsConfigFile | default "" | fromYaml -}}
{{- $gates := get $doc "featureGates" -}}
{{- $on := false -}}
{{- if kindIs "slice" $gates -}}
{{- range $gates -}}
{{- if has (toString . | nospace) (list "flowControl" "flowControl=true") -}}
{{- $on = true -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- if $on -}}
{{- $section := get $doc "flowControl" | default dict -}}
{{- include "inferencepool.seconds" (get $section "defaultRequestTTL" | default "60s") -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/*
The standalone Envoy's timeouts (YAML: messageTimeout, streamIdle, request,
route). With flow control on, the ext_proc message timeout and the stream idle
and request timeouts (those not 0s: none) are at least the TTL plus
envoy.timeouts.flowControlHeadroom, in whole seconds: a request waiting in the
picker's queue sends and receives nothing, and must not be failed by Envoy first.
The route timeout starts once the picker has let the request go: not raised.
*/}}
{{- define "inferencepool.envoyTimeouts" -}}
{{- $envoy := .Values.envoy -}}
{{- $t := $envoy.timeouts | default dict -}}
{{- $out := dict "messageTimeout" $envoy.extProc.messageTimeout -}}
{{- range $key := list "streamIdle" "request" "route" -}}
{{- $_ := set $out $key (get $t $key | default "0s") -}}
{{- end -}}
{{- $ttl := include "inferencepool.flowControlTTL" . -}}
{{- if ne $ttl "" -}}
{{- $headroom := include "inferencepool.seconds" (get $t "flowControlHeadroom" | default "30s") -}}
{{- $least := addf (float64 $ttl) (float64 $headroom) | ceil -}}
{{- range $key := list "messageTimeout" "streamIdle" "request" -}}
{{- $given := include "inferencepool.seconds" (get $out $key) | float64 -}}
{{- if and (or (eq $key "messageTimeout") (gt $given 0.0)) (lt $given $least) -}}
{{- $_ := set $out $key (printf "%ds" (int $least)) -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- toYaml $out -}}
{{- end -}}

{{/* default-plugins.yaml's flowControl section, from inferenceExtension.flowControl. */}}
{{- define "inferencepool.flowControlSection" -}}
{{- $fc := .Values.inferenceExtension.flowControl -}}
{{- $out := dict "defaultRequestTTL" (get $fc "defaultRequestTTL" | default "60s") -}}
{{- range $key := list "maxRequests" "maxBytes" "defaultPriorityBand" "defaultNegativePriorityBand" "priorityBands" "usageLimitPolicyPluginRef" -}}
{{- with get $fc $key -}}
{{- $_ := set $out $key . -}}
{{- end -}}
{{- end -}}
{{- toYaml $out -}}
{{- end -}}

{{/* One plugin entry of the EndpointPickerConfig: {type, name, parameters}. */}}
{{- define "inferencepool.pluginSpec" -}}
{{- $spec := dict "type" (get . "type") -}}
{{- $name := get . "name" -}}
{{- if and $name (ne $name (get . "type")) -}}
{{- $_ := set $spec "name" $name -}}
{{- end -}}
{{- with get . "parameters" -}}
{{- $_ := set $spec "parameters" . -}}
{{- end -}}
{{- toYaml $spec -}}
{{- end -}}

{{/*
The enabled scorers, in name order, as a YAML list of {type, name, parameters,
weight}.
*/}}
{{- define "inferencepool.scorerList" -}}
{{- $scorers := list -}}
{{- range $name, $s := .Values.inferenceExtension.scheduling.scorers -}}
{{- $s = $s | default dict -}}
{{- if or (not (hasKey $s "enabled")) (get $s "enabled") -}}
{{- $scorer := dict "type" (default $name (get $s "type")) "name" $name "weight" 1 -}}
{{- if hasKey $s "weight" -}}
{{- $_ := set $scorer "weight" (get $s "weight") -}}
{{- end -}}
{{- with get $s "parameters" -}}
{{- $_ := set $scorer "parameters" . -}}
{{- end -}}
{{- $scorers = append $scorers $scorer -}}
{{- end -}}
{{- end -}}
{{- toYaml $scorers -}}
{{- end -}}

{{/*
Every plugin of default-plugins.yaml in the order of the file: the other plugins
(data producers first, as the profiles' plugins read what they produce), filters,
scorers, picker, the P/D plugins (role filters, the decider, then the profile
handler that names it) and the metrics plugins a non-vLLM pool needs.
*/}}
{{- define "inferencepool.pluginList" -}}
{{- $s := .Values.inferenceExtension.scheduling -}}
{{- $plugins := list -}}
{{- range $s.plugins -}}
{{- $plugins = append $plugins (include "inferencepool.pluginSpec" . | fromYaml) -}}
{{- end -}}
{{- range $s.filters -}}
{{- $plugins = append $plugins (include "inferencepool.pluginSpec" . | fromYaml) -}}
{{- end -}}
{{- range (include "inferencepool.scorerList" . | fromYamlArray) -}}
{{- $plugins = append $plugins (include "inferencepool.pluginSpec" . | fromYaml) -}}
{{- end -}}
{{- $plugins = append $plugins (include "inferencepool.pluginSpec" $s.picker | fromYaml) -}}
{{- $pd := .Values.inferenceExtension.disaggregation | default dict -}}
{{- if get $pd "enabled" -}}
{{- $decider := dict "type" $pd.decider "parameters" (get ($pd.deciderParameters | default dict) $pd.decider) -}}
{{- $plugins = append $plugins (dict "type" "decode-filter") -}}
{{- $plugins = append $plugins (dict "type" "prefill-filter") -}}
{{- $plugins = append $plugins (include "inferencepool.pluginSpec" $decider | fromYaml) -}}
{{- $plugins = append $plugins (dict "type" "disagg-profile-handler" "parameters" (dict "deciders" (dict "prefill" $pd.decider))) -}}
{{- end -}}
{{- $engine := .Values.inferencePool.modelServerType -}}
{{- if ne $engine "vllm" -}}
{{- $plugins = append $plugins (dict "type" "metrics-data-source") -}}
{{- $plugins = append $plugins (dict "type" "core-metrics-extractor" "parameters" (dict "defaultEngine" $engine)) -}}
{{- end -}}
{{- toYaml $plugins -}}
{{- end -}}

{{/* default-plugins.yaml: the EndpointPickerConfig built from the values. */}}
{{- define "inferencepool.defaultPluginsConfig" -}}
{{- $s := .Values.inferenceExtension.scheduling -}}
{{- $refs := list -}}
{{- range $s.filters -}}
{{- $refs = append $refs (dict "pluginRef" (default (get . "type") (get . "name"))) -}}
{{- end -}}
{{- range (include "inferencepool.scorerList" . | fromYamlArray) -}}
{{- $refs = append $refs (dict "pluginRef" .name "weight" .weight) -}}
{{- end -}}
{{- $refs = append $refs (dict "pluginRef" (default (get $s.picker "type") (get $s.picker "name"))) -}}
{{- $fc := .Values.inferenceExtension.flowControl | default dict -}}
apiVersion: inference.networking.x-k8s.io/v1alpha1
kind: EndpointPickerConfig
{{- if get $fc "enabled" }}
featureGates: [flowControl]
{{- end }}
plugins:
{{- range (include "inferencepool.pluginList" . | fromYamlArray) }}
- {{ toYaml (dict "type" .type) }}
  {{- with get . "name" }}
  {{ toYaml (dict "name" .) }}
  {{- end }}
  {{- with get . "parameters" }}
  {{- toYaml (dict "parameters" .) | nindent 2 }}
  {{- end }}
{{- end }}
schedulingProfiles:
{{- if get (.Values.inferenceExtension.disaggregation | default dict) "enabled" }}
{{- range $role := list "decode" "prefill" }}
- name: {{ $role }}
  plugins:
  {{- toYaml (prepend $refs (dict "pluginRef" (printf "%s-filter" $role))) | nindent 2 }}
{{- end }}
{{- else }}
- name: default
  plugins:
  {{- toYaml $refs | nindent 2 }}
{{- end }}
{{- with $s.saturationDetector }}
saturationDetector:
  {{ toYaml (dict "pluginRef" .) }}
{{- end }}
{{- with .Values.inferenceObjectives }}
inferenceObjectives:
{{ toYaml . }}
{{- end }}
{{- if get $fc "enabled" }}
flowControl:
  {{- include "inferencepool.flowControlSection" . | nindent 2 }}
{{- end }}
{{- end -}}

{{/* The picker's flags; the Deployment passes them after `epp serve`. */}}
{{- define "inferencepool.eppArgs" -}}
{{- $ie := .Values.inferenceExtension -}}
{{- $pool := .Values.inferencePool -}}
{{- $args := list (printf "--config=/config/%s" $ie.pluginsConfigFile) -}}
{{- if $pool.enabled -}}
{{- $args = append $args (printf "--pool-name=%s" (include "inferencepool.poolName" .)) -}}
{{- $args = append $args (printf "--pool-namespace=%s" .Release.Namespace) -}}
{{- $args = append $args (printf "--pool-group=%s" (include "inferencepool.poolGroup" .)) -}}
{{- else -}}
{{- $args = append $args (printf "--endpoint-selector=%s" (include "inferencepool.selectorFlag" .)) -}}
{{- $args = append $args (printf "--endpoint-target-ports=%s" (include "inferencepool.targetPortsFlag" .)) -}}
{{- end -}}
{{- $args = append $args (printf "--grpc-port=%d" (int $ie.extProcPort)) -}}
{{- $args = append $args "--grpc-health-port=9003" -}}
{{- $args = append $args "--metrics-port=9090" -}}
{{- with get $ie.kvEvents "port" -}}
{{- $args = append $args (printf "--kv-events-port=%d" (int .)) -}}
{{- end -}}
{{- with get $ie.kvEvents "replayPort" -}}
{{- $args = append $args (printf "--kv-events-replay-port=%d" (int .)) -}}
{{- end -}}
{{- $args = append $args (printf "--shutdown-grace=%s" $ie.shutdownGrace) -}}
{{- $tls := $ie.secureServing | default dict -}}
{{- if get $tls "enabled" -}}
{{- $args = append $args "--secure-serving" -}}
{{- if get $tls "certSecretName" -}}
{{- $args = append $args "--cert-path=/etc/epp/tls" -}}
{{- $args = append $args "--enable-cert-reload" -}}
{{- end -}}
{{- end -}}
{{- range $name, $value := $ie.flags -}}
{{- if kindIs "bool" $value -}}
{{- if $value -}}
{{- $args = append $args (printf "--%s" $name) -}}
{{- end -}}
{{- else if kindIs "float64" $value -}}
{{- $args = append $args (printf "--%s=%s" $name (toJson $value)) -}}
{{- else if not (kindIs "invalid" $value) -}}
{{- $args = append $args (printf "--%s=%v" $name $value) -}}
{{- end -}}
{{- end -}}
{{- toYaml $args -}}
{{- end -}}
