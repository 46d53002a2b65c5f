{{/*
The cell's derived values, computed once from the values and the engine configs in files/
(links to configs/prefill and configs/decode), as JSON. Every invariant render.py used to
enforce is checked here, so `helm template` and `helm install` refuse a broken cell:
  * the Valkey shard count = ranks of one prefill engine (PCP x TP x PP); valkeySpec.shards
    may repeat it, any other value is refused;
  * LMCache's remote_url must have the valkey-lmcache-{rank} form; its namespace becomes the
    release's;
  * GPUs per pod = the engine's world size (x data-parallel size on decode);
  * the prefill pod's memory = LMCache's L1 for the pod + prefill.memoryOverheadGi;
  * the config mount = the directory of LMCACHE_CONFIG_FILE in configs/prefill/env;
  * prefill and decode name the same NIXL backends (nixlBackends sets them in both files);
  * the engine image is pinned by digest (unless allowUnpinnedImage), and so are Valkey's,
    the exporter's and a router image of its own;
  * /cache comes from exactly one of cache.volume and cache.claimTemplate;
  * hugepages2Mi is a whole number of 2 MiB pages;
  * the startup probe's budget covers VLLM_ENGINE_READY_TIMEOUT_S of each role's env file
    (the probe is derived from it: engineStartup);
  * the PriorityClass's name: priorityClass.name, or <release>.<namespace> (cluster-scoped, so
    two cells never share one by accident);
  * kvKeyEpoch is a key epoch a chunk key can carry, set in one place (it or lmcache.yaml).
*/}}

{{- define "glm53.need" -}}
{{- if not (index . 0) }}{{ fail (index . 1) }}{{ end -}}
{{- end -}}

{{- define "glm53.isInt" -}}
{{- $x := . -}}
{{- if and (or (kindIs "float64" $x) (kindIs "int64" $x) (kindIs "int" $x)) (eq (float64 (int64 $x)) (float64 $x)) }}yes{{ end -}}
{{- end -}}

{{/* A positive integer option of a vllm.yaml (dashes or underscores), default 1. */}}
{{- define "glm53.opt" -}}
{{- $cfg := index . 0 -}}{{- $name := index . 1 -}}{{- $file := index . 2 -}}
{{- $v := 1 -}}{{- $found := false -}}
{{- range $key := list $name (replace "-" "_" $name) -}}
{{- if and (not $found) (hasKey $cfg $key) -}}
{{- $found = true -}}
{{- $x := index $cfg $key -}}
{{- if or (not (include "glm53.isInt" $x)) (lt (int64 $x) 1) -}}
{{- fail (printf "%s: %s: expected a positive integer, got %v" $file $name $x) -}}
{{- end -}}
{{- $v = int64 $x -}}
{{- end -}}
{{- end -}}
{{- $v -}}
{{- end -}}

{{/* KEY=VALUE lines of an env file as a JSON list of {name, value}. */}}
{{- define "glm53.envFile" -}}
{{- $text := index . 0 -}}{{- $file := index . 1 -}}
{{- $out := list -}}
{{- range $raw := splitList "\n" $text -}}
{{- $line := trim $raw -}}
{{- if and $line (not (hasPrefix "#" $line)) -}}
{{- if not (contains "=" $line) }}{{ fail (printf "%s: expected KEY=VALUE, got %q" $file $raw) }}{{ end -}}
{{- $kv := splitn "=" 2 $line -}}
{{- if eq (trim $kv._0) "VLLM_NIXL_SIDE_CHANNEL_HOST" -}}
{{- fail (printf "%s: VLLM_NIXL_SIDE_CHANNEL_HOST is per pod (its IP); the chart sets it, remove it from the env file" $file) -}}
{{- end -}}
{{- $out = append $out (dict "name" (trim $kv._0) "value" $kv._1) -}}
{{- end -}}
{{- end -}}
{{- toJson $out -}}
{{- end -}}

{{/* The NIXL backends of a vllm.yaml: NixlConnector alone or as a MultiConnector child. */}}
{{- define "glm53.nixlBackends" -}}
{{- $cfg := . -}}
{{- $ktc := dict -}}
{{- if hasKey $cfg "kv-transfer-config" }}{{ $ktc = index $cfg "kv-transfer-config" }}{{ else if hasKey $cfg "kv_transfer_config" }}{{ $ktc = index $cfg "kv_transfer_config" }}{{ end -}}
{{- $nodes := list $ktc -}}
{{- $extra := (get $ktc "kv_connector_extra_config") | default dict -}}
{{- range $c := (get $extra "connectors") | default list }}{{ $nodes = append $nodes $c }}{{ end -}}
{{- $found := list -}}{{- $done := false -}}
{{- range $n := $nodes -}}
{{- if and (not $done) (eq (toString (get $n "kv_connector")) "NixlConnector") -}}
{{- $done = true -}}
{{- $found = (get ((get $n "kv_connector_extra_config") | default dict) "backends") | default (list "UCX") -}}
{{- end -}}
{{- end -}}
{{- toJson $found -}}
{{- end -}}

{{- define "glm53.imageLdLibraryPath" -}}
{{- /* The serving image's LD_LIBRARY_PATH (Dockerfile, runtime stage; none today). A pod env
var replaces the image's, so the node-libfabric path repeats it after the node's folders;
tests/configs/test_deploy.py checks that it equals the Dockerfile's. */ -}}
{{- end -}}

{{- define "glm53.cell" -}}
{{- $v := .Values -}}
{{- $ns := .Release.Namespace -}}
{{- include "glm53.need" (list (regexMatch "^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$" $ns) (printf "namespace %q is not a DNS-1123 label" $ns)) -}}

{{- /* images */ -}}
{{- include "glm53.need" (list (ne $v.image "") "image: set the serving image (values.yaml marks it MUST), by digest: REGISTRY/glm53-b300@sha256:<digest> (make image prints it)") -}}
{{- $pinned := regexMatch "^[^\\s@]+@sha256:[0-9a-f]{64}$" $v.image -}}
{{- include "glm53.need" (list (or $pinned $v.allowUnpinnedImage) (printf "image %q is not pinned by digest (@sha256:<64 hex>): prefill and decode must run identical bits for NIXL's handshake and a tag can move; give REGISTRY/glm53-b300@sha256:<digest> (make image prints it), or set allowUnpinnedImage=true for development" $v.image)) -}}
{{- $digest := "^[^\\s@]+@sha256:[0-9a-f]{64}$" -}}
{{- include "glm53.need" (list (regexMatch $digest $v.valkeySpec.image) (printf "valkeySpec.image %q: give Valkey 8.1 by digest (e.g. valkey/valkey@sha256:<digest of 8.1>)" $v.valkeySpec.image)) -}}
{{- if $v.monitoring.valkeyExporter.enabled -}}
{{- include "glm53.need" (list (regexMatch $digest $v.monitoring.valkeyExporter.image) (printf "monitoring.valkeyExporter.image %q: give the exporter by digest" $v.monitoring.valkeyExporter.image)) -}}
{{- end -}}
{{- if $v.router.image -}}
{{- include "glm53.need" (list (or (regexMatch $digest $v.router.image) $v.allowUnpinnedImage) (printf "router.image %q is not pinned by digest (@sha256:<64 hex>): give the router's image by digest, or null for the serving image (allowUnpinnedImage=true accepts a tag for development)" $v.router.image)) -}}
{{- end -}}
{{- if $v.nixlHostLibfabric -}}
{{- include "glm53.need" (list (not (has (base (trimSuffix "/" $v.nixlHostLibfabric)) (list "lib" "lib64"))) (printf "nixlHostLibfabric: %q is a library folder; give the installation prefix (e.g. /opt/amazon/efa): its lib64 and lib are both put on LD_LIBRARY_PATH" $v.nixlHostLibfabric)) -}}
{{- end -}}
{{- /* The volume sources, without the keys a values file set to null beside its own (Helm merges
maps; `helm template` drops such keys, `helm lint` keeps them): exactly one is left. */ -}}
{{- $modelVolume := dict -}}
{{- range $k, $x := $v.model.volume }}{{ if not (kindIs "invalid" $x) }}{{ $_ := set $modelVolume $k $x }}{{ end }}{{ end -}}
{{- include "glm53.need" (list (eq (len $modelVolume) 1) (printf "model.volume: give one volume source, got %d (%s); a values file that gives its own sets the default's to null beside it, e.g. hostPath: null (Helm merges maps)" (len $modelVolume) (keys $modelVolume | sortAlpha | join ", "))) -}}
{{- $cacheVolume := dict -}}
{{- range $k, $x := ($v.cache.volume | default dict) }}{{ if not (kindIs "invalid" $x) }}{{ $_ := set $cacheVolume $k $x }}{{ end }}{{ end -}}
{{- include "glm53.need" (list (le (len $cacheVolume) 1) (printf "cache.volume: give one volume source, got %d (%s); a values file that gives its own sets the default's to null beside it, e.g. hostPath: null (Helm merges maps)" (len $cacheVolume) (keys $cacheVolume | sortAlpha | join ", "))) -}}
{{- /* /cache: one volume source shared by the pods of a role, or a PVC per pod */ -}}
{{- $cacheClaim := $v.cache.claimTemplate -}}
{{- include "glm53.need" (list (not (and $cacheVolume $cacheClaim)) "cache: set cache.volume or cache.claimTemplate, not both (cache.volume: null to give every engine pod a claim of its own)") -}}
{{- include "glm53.need" (list (or $cacheVolume $cacheClaim) "cache: set cache.volume (a volume source) or cache.claimTemplate (a PersistentVolumeClaim per engine pod)") -}}
{{- /* hugepages-2Mi: whole 2 MiB pages */ -}}
{{- with $v.hugepages2Mi -}}
{{- if hasSuffix "Mi" . -}}
{{- include "glm53.need" (list (eq (mod (atoi (trimSuffix "Mi" .)) 2) 0) (printf "hugepages2Mi %q is not a whole number of 2 MiB pages (give an even number of Mi, or Gi)" .)) -}}
{{- end -}}
{{- end -}}
{{- if and $v.cacheWarming.enabled (hasKey $modelVolume "hostPath") -}}
{{- fail "cacheWarming.enabled: model.volume is a hostPath, a copy on each node: the Job would read one node's copy only. Warming is for a shared file system (model.volume: a persistentVolumeClaim, e.g. configs/deploy/examples/fsx-lustre.yaml)" -}}
{{- end -}}
{{- /* the PriorityClass (cluster-scoped) */ -}}
{{- $priorityClass := $v.priorityClass.name -}}
{{- if not $priorityClass -}}
{{- include "glm53.need" (list $v.priorityClass.create "priorityClass.name: with priorityClass.create false, name the existing PriorityClass the cell's pods use (e.g. the first cell's, glm53.<its namespace>)") -}}
{{- $priorityClass = printf "%s.%s" .Release.Name $ns -}}
{{- end -}}
{{- $mount := printf "%s/" (trimSuffix "/" $v.model.mount) -}}
{{- include "glm53.need" (list (hasPrefix $mount $v.model.path) (printf "model.path %q is not inside model.mount %q" $v.model.path $v.model.mount)) -}}

{{- /* engine configs */ -}}
{{- $pf := "configs/prefill/vllm.yaml" -}}{{- $df := "configs/decode/vllm.yaml" -}}
{{- $prefillText := $.Files.Get "files/prefill/vllm.yaml" -}}
{{- $decodeText := $.Files.Get "files/decode/vllm.yaml" -}}
{{- $lmText := $.Files.Get "files/prefill/lmcache.yaml" -}}
{{- include "glm53.need" (list (and $prefillText $decodeText $lmText) "files/prefill/{vllm,lmcache}.yaml or files/decode/vllm.yaml is missing: the chart's files/ must link to configs/prefill and configs/decode") -}}
{{- $prefill := fromYaml $prefillText -}}{{- $decode := fromYaml $decodeText -}}
{{- include "glm53.need" (list (not (hasKey $prefill "Error")) (printf "%s: %v" $pf (get $prefill "Error"))) -}}
{{- include "glm53.need" (list (not (hasKey $decode "Error")) (printf "%s: %v" $df (get $decode "Error"))) -}}
{{- $prefillEnv := include "glm53.envFile" (list ($.Files.Get "files/prefill/env") "configs/prefill/env") | fromJsonArray -}}
{{- $decodeEnv := include "glm53.envFile" (list ($.Files.Get "files/decode/env") "configs/decode/env") | fromJsonArray -}}

{{- /* VLLM_ENGINE_READY_TIMEOUT_S of each role (vLLM's default, 600, when its env file has none):
the startup probe's budget is built on it */ -}}
{{- $readyTimeouts := dict -}}
{{- range $role, $roleEnv := dict "prefill" $prefillEnv "decode" $decodeEnv -}}
{{- $t := "600" -}}
{{- range $e := $roleEnv }}{{ if eq $e.name "VLLM_ENGINE_READY_TIMEOUT_S" }}{{ $t = trim $e.value }}{{ end }}{{ end -}}
{{- include "glm53.need" (list (regexMatch "^[1-9][0-9]*$" $t) (printf "configs/%s/env: VLLM_ENGINE_READY_TIMEOUT_S=%s: expected whole seconds (the startup probe's budget is built on it)" $role $t)) -}}
{{- $_ := set $readyTimeouts $role (atoi $t) -}}
{{- end -}}

{{- $configFile := "" -}}
{{- range $e := $prefillEnv }}{{ if eq $e.name "LMCACHE_CONFIG_FILE" }}{{ $configFile = $e.value }}{{ end }}{{ end -}}
{{- include "glm53.need" (list (and (hasPrefix "/" $configFile) (eq (base $configFile) "lmcache.yaml")) (printf "configs/prefill/env: LMCACHE_CONFIG_FILE must be an absolute path ending in /lmcache.yaml (the ConfigMap is mounted at its directory), got %q" $configFile)) -}}
{{- $prefillMount := dir $configFile -}}
{{- $decodeMount := printf "%s/decode" (dir $prefillMount) -}}

{{- /* nixlBackends: one `backends: [...]` line per vllm.yaml, rewritten in both roles */ -}}
{{- if $v.nixlBackends -}}
{{- $line := printf "backends: [%s]" (join ", " $v.nixlBackends) -}}
{{- $re := "backends: \\[[A-Za-z0-9_, ]*\\]" -}}
{{- $np := len (regexFindAll $re $prefillText -1) -}}{{- $nd := len (regexFindAll $re $decodeText -1) -}}
{{- include "glm53.need" (list (eq $np 1) (printf "nixlBackends: %s has %d `backends: [...]` lines, so the chart cannot tell which to set; keep exactly one (the NixlConnector's)" $pf $np)) -}}
{{- include "glm53.need" (list (eq $nd 1) (printf "nixlBackends: %s has %d `backends: [...]` lines, so the chart cannot tell which to set; keep exactly one (the NixlConnector's)" $df $nd)) -}}
{{- $prefillText = regexReplaceAll $re $prefillText $line -}}
{{- $decodeText = regexReplaceAll $re $decodeText $line -}}
{{- $prefill = fromYaml $prefillText -}}{{- $decode = fromYaml $decodeText -}}
{{- $set := include "glm53.nixlBackends" $prefill -}}
{{- include "glm53.need" (list (eq $set (toJson $v.nixlBackends)) (printf "nixlBackends: the `backends: [...]` line of %s is not its NixlConnector's (after setting it, the connector uses %s)" $pf $set)) -}}
{{- end -}}
{{- $pb := include "glm53.nixlBackends" $prefill | fromJsonArray -}}
{{- $db := include "glm53.nixlBackends" $decode | fromJsonArray -}}
{{- include "glm53.need" (list (eq (toJson $pb) (toJson $db)) (printf "NIXL backends differ: %s uses %s, %s uses %s" $pf (toJson $pb) $df (toJson $db))) -}}

{{- /* ranks and shards */ -}}
{{- $pcp := include "glm53.opt" (list $prefill "prefill-context-parallel-size" $pf) | int64 -}}
{{- $tp := include "glm53.opt" (list $prefill "tensor-parallel-size" $pf) | int64 -}}
{{- $pp := include "glm53.opt" (list $prefill "pipeline-parallel-size" $pf) | int64 -}}
{{- $pdp := include "glm53.opt" (list $prefill "data-parallel-size" $pf) | int64 -}}
{{- $ranks := mul $pcp $tp $pp -}}
{{- $ddp := include "glm53.opt" (list $decode "data-parallel-size" $df) | int64 -}}
{{- $decodeRanks := mul (include "glm53.opt" (list $decode "prefill-context-parallel-size" $df) | int64) (include "glm53.opt" (list $decode "tensor-parallel-size" $df) | int64) (include "glm53.opt" (list $decode "pipeline-parallel-size" $df) | int64) -}}
{{- $asked := $v.valkeySpec.shards -}}
{{- if and (not (kindIs "invalid" $asked)) (ne (int64 $asked) $ranks) -}}
{{- $gap := "" -}}
{{- if lt (int64 $asked) $ranks }}{{ $gap = printf "ranks %d..%d would address shards that do not exist" (int64 $asked) (sub $ranks 1) }}{{ else }}{{ $gap = printf "shards %d..%d would never be read or written" $ranks (sub (int64 $asked) 1) }}{{ end -}}
{{- fail (printf "valkeySpec.shards=%d does not match the prefill engine's %d ranks (%s: prefill-context-parallel-size %d x tensor-parallel-size %d x pipeline-parallel-size %d): rank r reads valkey-lmcache-r through remote_url's {rank}, so %s. Leave valkeySpec.shards null or set it to %d." (int64 $asked) $ranks $pf $pcp $tp $pp $gap $ranks) -}}
{{- end -}}

{{- /* LMCache: remote_url points at this release's shard Services; the pod's L1 */ -}}
{{- $lm := fromYaml $lmText -}}
{{- $url := toString (get $lm "remote_url") -}}
{{- $urlRe := "^resp://valkey-lmcache-\\{rank\\}\\.[a-z0-9]([-a-z0-9]*[a-z0-9])?\\.svc\\.cluster\\.local:6379$" -}}
{{- include "glm53.need" (list (regexMatch $urlRe $url) (printf "configs/prefill/lmcache.yaml: remote_url %q does not address the rendered Valkey shards; expected \"resp://valkey-lmcache-{rank}.<namespace>.svc.cluster.local:6379\" (one valkey-lmcache-<rank> Service per prefill rank)" $url)) -}}
{{- $newUrl := printf "resp://valkey-lmcache-{rank}.%s.svc.cluster.local:6379" $ns -}}
{{- if ne $url $newUrl -}}
{{- $n := len (regexFindAll (regexQuoteMeta $url) $lmText -1) -}}
{{- include "glm53.need" (list (eq $n 1) (printf "configs/prefill/lmcache.yaml: remote_url %q appears %d times in the text" $url $n)) -}}
{{- $lmText = replace $url $newUrl $lmText -}}
{{- end -}}
{{- $lm = fromYaml $lmText -}}
{{- include "glm53.need" (list (eq (toString (get $lm "remote_url")) $newUrl) (printf "configs/prefill/lmcache.yaml: could not point remote_url at namespace %q" $ns)) -}}
{{- /* kvKeyEpoch: LMCache's kv_key_epoch (patch 0030), which every chunk key carries, written into the
prefill engines' lmcache.yaml. "" leaves the file as it is: the image's entrypoint then gives the
image's own epoch (imagectl/keyepoch.py); "none" writes an empty one (no epoch). */ -}}
{{- $epoch := toString $v.kvKeyEpoch -}}
{{- if $epoch -}}
{{- include "glm53.need" (list (not (hasKey $lm "kv_key_epoch")) (printf "kvKeyEpoch %q: configs/prefill/lmcache.yaml sets kv_key_epoch already (%v); set the epoch in one of the two" $epoch (get $lm "kv_key_epoch"))) -}}
{{- include "glm53.need" (list (or (eq $epoch "none") (regexMatch "^[A-Za-z0-9][A-Za-z0-9._+-]{0,63}$" $epoch)) (printf "kvKeyEpoch %q cannot be part of a chunk key: give 1 to 64 letters, digits, '.', '_', '+' or '-', starting with a letter or a digit (\"\" for the image's own, none for no epoch)" $epoch)) -}}
{{- $lmText = printf "%s\n\n# The chart's kvKeyEpoch: LMCache's key epoch, in every chunk key (patch 0030).\nkv_key_epoch: %s\n" (trimSuffix "\n" $lmText) (toJson (ternary "" $epoch (eq $epoch "none"))) -}}
{{- $lm = fromYaml $lmText -}}
{{- end -}}
{{- $size := 5.0 -}}
{{- if hasKey $lm "max_local_cpu_size" }}{{ $size = get $lm "max_local_cpu_size" }}{{ end -}}
{{- include "glm53.need" (list (and (or (kindIs "float64" $size) (kindIs "int64" $size)) (gt (float64 $size) 0.0)) (printf "configs/prefill/lmcache.yaml: max_local_cpu_size %v: expected a positive number of GiB" $size)) -}}
{{- $extra := (get $lm "extra_config") | default dict -}}
{{- $l1 := mulf (float64 $size) $ranks -}}
{{- if and (get $extra "pcp_shard_store") (gt $ranks 1) -}}
{{- $l1 = float64 ((get $extra "first_rank_max_local_cpu_size") | default $size) -}}
{{- end -}}
{{- $prefillMemory := add (ceil $l1 | int64) $v.prefill.memoryOverheadGi -}}

{{- $prefillData := dict "vllm.yaml" $prefillText "lmcache.yaml" $lmText -}}
{{- $decodeData := dict "vllm.yaml" $decodeText -}}
{{- toJson (dict
  "namespace" $ns "ranks" $ranks "shards" $ranks
  "prefillGpus" (mul $ranks $pdp) "decodeGpus" (mul $decodeRanks $ddp)
  "prefillDataParallel" $pdp "decodeDataParallel" $ddp
  "prefillMemoryGi" $prefillMemory "l1Gi" $l1
  "prefillEnv" $prefillEnv "decodeEnv" $decodeEnv
  "prefillMount" $prefillMount "decodeMount" $decodeMount
  "prefillData" $prefillData "decodeData" $decodeData
  "prefillSha" (sha256sum (toJson (list $prefillData $prefillEnv)))
  "decodeSha" (sha256sum (toJson (list $decodeData $decodeEnv)))
  "readyTimeouts" $readyTimeouts "priorityClass" $priorityClass
  "modelVolume" $modelVolume "cacheVolume" $cacheVolume
  "pinned" $pinned) -}}
{{- end -}}

{{- define "glm53.labels" -}}
app.kubernetes.io/name: glm53
app.kubernetes.io/component: {{ . }}
app.kubernetes.io/part-of: glm53-pd-cell
{{- end -}}

{{- define "glm53.cellLabel" -}}
glm53.io/cell: {{ .Values.cell.name | quote }}
{{- end -}}

{{/* nodeSelector of a GPU-node pod: the pool's plus the cell's node label. */}}
{{- define "glm53.nodeSelector" -}}
{{- $root := index . 0 -}}{{- $sel := deepCopy (index . 1) -}}
{{- if $root.Values.cell.nodeLabel }}{{ $_ := set $sel $root.Values.cell.nodeLabel $root.Values.cell.name }}{{ end -}}
{{- toYaml $sel -}}
{{- end -}}
