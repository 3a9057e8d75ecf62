{{/*
Names, labels and shared fragments. Every object name and label in this chart comes from here.
*/}}

{{/*
Chart name, truncated to a DNS label.
Usage: include "shopsimrl.name" .
*/}}
{{- define "shopsimrl.name" -}}
{{- .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/*
Release-scoped base name: the release name, with the chart name appended unless it already
contains it. Kept to 40 characters so "<fullname>-<component>" stays a valid Service name.
Usage: include "shopsimrl.fullname" .
*/}}
{{- define "shopsimrl.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 40 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{/*
Name of one component's objects (Deployment, Service, Job).
Usage: include "shopsimrl.componentName" (dict "ctx" . "component" "vllm")
*/}}
{{- define "shopsimrl.componentName" -}}
{{- printf "%s-%s" (include "shopsimrl.fullname" .ctx) .component | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/*
"name-version" of the chart, for the helm.sh/chart label.
Usage: include "shopsimrl.chart" .
*/}}
{{- define "shopsimrl.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/*
Selector labels of one component; stable across upgrades, so Deployments keep their pods.
Usage: include "shopsimrl.selectorLabels" (dict "ctx" . "component" "worker")
*/}}
{{- define "shopsimrl.selectorLabels" -}}
app.kubernetes.io/name: {{ include "shopsimrl.name" .ctx }}
app.kubernetes.io/instance: {{ .ctx.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{/*
Full label set of one component's objects: selector labels plus chart, version and run.
Usage: include "shopsimrl.labels" (dict "ctx" . "component" "worker")
*/}}
{{- define "shopsimrl.labels" -}}
{{ include "shopsimrl.selectorLabels" . }}
app.kubernetes.io/part-of: shopsimrl
app.kubernetes.io/managed-by: {{ .ctx.Release.Service }}
app.kubernetes.io/version: {{ .ctx.Chart.AppVersion | quote }}
helm.sh/chart: {{ include "shopsimrl.chart" .ctx }}
shopsimrl.io/run: {{ include "shopsimrl.runName" .ctx | quote }}
{{- end -}}

{{/*
Labels of a pod template: the selector labels plus part-of and managed-by, nothing that changes
with the chart or app version. A Deployment rolls its pods when its template changes, and a
rolled ShopSimulator is a second lease pool behind the same Service; a Job's template is
immutable, so a changed label would make `helm upgrade` fail on it. Jobs add their run label
(part of the Job's identity, so stable for the Job).
Usage: include "shopsimrl.podLabels" (dict "ctx" . "component" "worker")
*/}}
{{- define "shopsimrl.podLabels" -}}
{{ include "shopsimrl.selectorLabels" . }}
app.kubernetes.io/part-of: shopsimrl
app.kubernetes.io/managed-by: {{ .ctx.Release.Service }}
{{- end -}}

{{/*
Run name: run.name, or the release name.
Usage: include "shopsimrl.runName" .
*/}}
{{- define "shopsimrl.runName" -}}
{{- default .Release.Name .Values.run.name -}}
{{- end -}}

{{/*
Run URI the workers write to: run.uri, or storage.baseUri + "/" + run name. Fails the render
when neither is set, naming both keys.
Usage: include "shopsimrl.runUri" .
*/}}
{{- define "shopsimrl.runUri" -}}
{{- if .Values.run.uri -}}
{{- .Values.run.uri | trimSuffix "/" -}}
{{- else if .Values.storage.baseUri -}}
{{- printf "%s/%s" (.Values.storage.baseUri | trimSuffix "/") (include "shopsimrl.runName" .) -}}
{{- else -}}
{{- fail "set storage.baseUri (runs go to <baseUri>/<run name>) or run.uri (the full run URI)" -}}
{{- end -}}
{{- end -}}

{{/*
The `config` value parsed (mapping or YAML string) and checked: sets "cfg" in the dict passed as
"out" (include returns only strings, so the mapping travels through it).
Usage: include "shopsimrl.parseConfig" (dict "ctx" . "out" $out)
*/}}
{{- define "shopsimrl.parseConfig" -}}
{{- $v := .ctx.Values -}}
{{- $cfg := $v.config -}}
{{- if or (kindIs "invalid" $v.config) (and (kindIs "string" $v.config) (not (trim $v.config))) -}}
{{- fail "config: missing; give the experiment YAML, e.g. --set-file config=configs/qwen35_4b_val.yaml, or a config mapping in your values" -}}
{{- /* Reached only under `helm lint`, which logs a fail and renders on. */ -}}
{{- $cfg = dict -}}
{{- end -}}
{{- if kindIs "string" $v.config -}}
{{- $cfg = fromYaml $v.config -}}
{{- if hasKey $cfg "Error" -}}
{{- fail (printf "config: not valid YAML: %s" (get $cfg "Error")) -}}
{{- end -}}
{{- end -}}
{{- if eq $v.mode "judge" -}}
{{- range $key := list "source" "rubric" "model" -}}
{{- if not (hasKey $cfg $key) -}}
{{- fail (printf "config.%s: missing; in judge mode config is a judge config (JUDGE.yaml: source, rubric, model)" $key) -}}
{{- end -}}
{{- end -}}
{{- if not (kindIs "invalid" $v.run.inlineSplitFile) -}}
{{- fail "run.inlineSplitFile: a judge reads frozen traces, it takes no split file" -}}
{{- end -}}
{{- if not (kindIs "invalid" $v.run.inlineSkillsFile) -}}
{{- fail "run.inlineSkillsFile: a judge reads frozen traces, it takes no skill bank" -}}
{{- end -}}
{{- else if eq $v.mode "skills" -}}
{{- range $key := list "experiment" "analyst_model" -}}
{{- if not (hasKey $cfg $key) -}}
{{- fail (printf "config.%s: missing; in skills mode config is a skills config (SKILLS.yaml: experiment, analyst_model)" $key) -}}
{{- end -}}
{{- end -}}
{{- if not (kindIs "invalid" $v.run.inlineSplitFile) -}}
{{- fail "run.inlineSplitFile: the skill analysts read frozen traces, they take no split file" -}}
{{- end -}}
{{- if not (kindIs "invalid" $v.run.inlineSkillsFile) -}}
{{- fail "run.inlineSkillsFile: the skill analysts read frozen traces, they take no skill bank" -}}
{{- end -}}
{{- else if not (kindIs "map" (get $cfg "tasks")) -}}
{{- fail "config.tasks: missing; the experiment config needs tasks.split_file and tasks.split" -}}
{{- $cfg = dict "tasks" (dict) -}}
{{- end -}}
{{- $_ := set .out "cfg" $cfg -}}
{{- end -}}

{{/*
The experiment config as rendered into the ConfigMap: the `config` value (mapping or YAML
string) with tasks.split_file and skills.path pointed at the inline files when they are given.
Usage: include "shopsimrl.configYaml" .
*/}}
{{- define "shopsimrl.configYaml" -}}
{{- $inlineSplit := not (kindIs "invalid" .Values.run.inlineSplitFile) -}}
{{- $inlineSkills := not (kindIs "invalid" .Values.run.inlineSkillsFile) -}}
{{- $out := dict -}}
{{- include "shopsimrl.parseConfig" (dict "ctx" . "out" $out) -}}
{{- $cfg := $out.cfg -}}
{{- if and (kindIs "string" .Values.config) (not $inlineSplit) (not $inlineSkills) -}}
{{- /* A YAML string is kept verbatim (comments, number formats) when nothing is rewritten. */ -}}
{{- .Values.config | trim -}}
{{- else -}}
{{- $cfg = deepCopy $cfg -}}
{{- if $inlineSplit -}}
{{- $_ := set (get $cfg "tasks") "split_file" (include "shopsimrl.inlineSplitRelPath" .) -}}
{{- end -}}
{{- if $inlineSkills -}}
{{- $_ := set (get $cfg "skills") "path" (include "shopsimrl.inlineSkillsRelPath" .) -}}
{{- end -}}
{{- toYaml $cfg -}}
{{- end -}}
{{- end -}}

{{/*
Short hash of what identifies one worker Job: run URI, attempt, shard count and config. It goes
into Job and ConfigMap names, so a changed evaluation is a new Job rather than an update of the
old one, whose pod template is immutable.
Usage: include "shopsimrl.runHash" .
*/}}
{{- define "shopsimrl.runHash" -}}
{{- $parts := list (include "shopsimrl.runUri" .) (toString .Values.run.attempt) (toString .Values.job.shards) (include "shopsimrl.configYaml" .) (toJson .Values.run.inlineSplitFile) (toJson .Values.run.inlineSkillsFile) -}}
{{- join "\n" $parts | sha256sum | trunc 8 -}}
{{- end -}}

{{/*
Name stem shared by the run's Jobs: release plus run name (once when they are equal), made a
DNS label and cut so "<stem>-<hash>-<index>" pod hostnames stay within 63 characters.
Usage: include "shopsimrl.runStem" .
*/}}
{{- define "shopsimrl.runStem" -}}
{{- $run := include "shopsimrl.runName" . -}}
{{- $stem := .Release.Name -}}
{{- if ne $run .Release.Name -}}
{{- $stem = printf "%s-%s" .Release.Name $run -}}
{{- end -}}
{{- $stem | lower | replace "_" "-" | replace "." "-" | trunc 40 | trimSuffix "-" -}}
{{- end -}}

{{/*
Name of the worker Job: "<stem>-<hash>".
Usage: include "shopsimrl.jobName" .
*/}}
{{- define "shopsimrl.jobName" -}}
{{- $stem := include "shopsimrl.runStem" . -}}
{{- if .Values.jobSet.enabled -}}
{{- /* The JobSet names its worker pods "<name>-worker-0-<index>-<5 random>", a DNS label of at
       most 63 characters: keep the stem to 38 minus the digits of the last index. */ -}}
{{- $digits := len (toString (sub (int .Values.job.shards) 1)) -}}
{{- $stem = $stem | trunc (int (sub 38 $digits)) | trimSuffix "-" -}}
{{- end -}}
{{- printf "%s-%s" $stem (include "shopsimrl.runHash" .) -}}
{{- end -}}

{{/*
Name of the reducer Job: "<stem>-<hash>-reduce".
Usage: include "shopsimrl.reducerJobName" .
*/}}
{{- define "shopsimrl.reducerJobName" -}}
{{- printf "%s-reduce" (include "shopsimrl.jobName" .) -}}
{{- end -}}

{{/*
ServiceAccount of the reducer pod: with watchWorkerJob its own (reducer.serviceAccount, the only
identity the Role is bound to), else the workers' (worker.serviceAccountName, "" = default).
Usage: include "shopsimrl.reducerServiceAccount" .
*/}}
{{- define "shopsimrl.reducerServiceAccount" -}}
{{- $sa := .Values.reducer.serviceAccount -}}
{{- if not .Values.reducer.watchWorkerJob -}}
{{- .Values.worker.serviceAccountName -}}
{{- else if $sa.create -}}
{{- default (include "shopsimrl.componentName" (dict "ctx" . "component" "reducer")) $sa.name -}}
{{- else -}}
{{- $sa.name -}}
{{- end -}}
{{- end -}}

{{/*
Name of the ConfigMap holding the config of this Job.
Usage: include "shopsimrl.configMapName" .
*/}}
{{- define "shopsimrl.configMapName" -}}
{{- printf "%s-config" (include "shopsimrl.jobName" .) -}}
{{- end -}}

{{/*
Directory of the image's configs; the run config is mounted into it so relative paths in the
config resolve against the shipped splits and prompts.
Usage: include "shopsimrl.configDir" .
*/}}
{{- define "shopsimrl.configDir" -}}
/app/configs
{{- end -}}

{{/*
File name of the mounted config: "<run name>.yaml", so the experiment name defaults to the run name.
Usage: include "shopsimrl.configFileName" .
*/}}
{{- define "shopsimrl.configFileName" -}}
{{- printf "%s.yaml" (include "shopsimrl.runName" .) -}}
{{- end -}}

{{/*
Path of the inline split file relative to the config directory: inline/split/ plus the file name
the config names. The file name is part of the split's identity in the plan fingerprint, so a
release plans exactly what `shopsimrl plan` plans from the same config and split locally.
Usage: include "shopsimrl.inlineSplitRelPath" .
*/}}
{{- define "shopsimrl.inlineSplitRelPath" -}}
{{- $out := dict -}}
{{- include "shopsimrl.parseConfig" (dict "ctx" . "out" $out) -}}
{{- $name := get (get $out.cfg "tasks") "split_file" -}}
{{- if not (and (kindIs "string" $name) $name) -}}
{{- fail "run.inlineSplitFile needs config.tasks.split_file: its file name is kept for the inline split (it is part of the plan fingerprint)" -}}
{{- end -}}
{{- printf "inline/split/%s" (base (toString $name)) -}}
{{- end -}}

{{/*
Path of the inline skills file (a skill bank, or a gate's skill_assignments.json) relative to the
config directory: inline/skills/ plus the file name config.skills.path names.
Usage: include "shopsimrl.inlineSkillsRelPath" .
*/}}
{{- define "shopsimrl.inlineSkillsRelPath" -}}
{{- $out := dict -}}
{{- include "shopsimrl.parseConfig" (dict "ctx" . "out" $out) -}}
{{- $skills := get $out.cfg "skills" -}}
{{- $name := "" -}}
{{- if kindIs "map" $skills -}}
{{- $name = get $skills "path" -}}
{{- end -}}
{{- if not (and (kindIs "string" $name) $name) -}}
{{- fail "run.inlineSkillsFile needs config.skills.path (the file it replaces); a config with skills.path: null runs without skills" -}}
{{- end -}}
{{- printf "inline/skills/%s" (base (toString $name)) -}}
{{- end -}}

{{/*
An inline file's text as the ConfigMap holds it: a string verbatim, a mapping as JSON.
Usage: include "shopsimrl.inlineText" .Values.run.inlineSplitFile
*/}}
{{- define "shopsimrl.inlineText" -}}
{{- if kindIs "string" . -}}
{{- . -}}
{{- else -}}
{{- toPrettyJson . -}}
{{- end -}}
{{- end -}}

{{/*
Image reference "repository:tag" from an image block, with a fallback tag.
Usage: include "shopsimrl.image" (dict "image" .Values.worker.image "defaultTag" .Chart.AppVersion)
*/}}
{{- define "shopsimrl.image" -}}
{{- printf "%s:%s" .image.repository (default .defaultTag .image.tag) -}}
{{- end -}}

{{/*
Image reference of a component whose image block falls back to the worker image field by field
(the testbed's, the reducer's).
Usage: include "shopsimrl.componentImage" (dict "ctx" . "image" .Values.reducer.image)
*/}}
{{- define "shopsimrl.componentImage" -}}
{{- $w := .ctx.Values.worker.image -}}
{{- printf "%s:%s" (default $w.repository .image.repository) (default (default .ctx.Chart.AppVersion $w.tag) .image.tag) -}}
{{- end -}}

{{/*
Model base URL the workers use, or "" to keep the config's: the testbed policy, the release's
vLLM, or model.baseUrl, in that order.
Usage: include "shopsimrl.modelBaseUrl" .
*/}}
{{- define "shopsimrl.modelBaseUrl" -}}
{{- if .Values.testbed.enabled -}}
{{- printf "http://%s:%d/v1" (include "shopsimrl.componentName" (dict "ctx" . "component" "testbed-policy")) (int .Values.testbed.policy.port) -}}
{{- else if .Values.vllm.enabled -}}
{{- printf "http://%s:%d/v1" (include "shopsimrl.componentName" (dict "ctx" . "component" "vllm")) (int .Values.vllm.port) -}}
{{- else -}}
{{- .Values.model.baseUrl -}}
{{- end -}}
{{- end -}}

{{/*
Environment (ShopSimulator) base URL the workers use, or "" to keep the config's.
Usage: include "shopsimrl.envBaseUrl" .
*/}}
{{- define "shopsimrl.envBaseUrl" -}}
{{- if .Values.testbed.enabled -}}
{{- printf "http://%s:%d" (include "shopsimrl.componentName" (dict "ctx" . "component" "testbed-shop")) (int .Values.testbed.shop.port) -}}
{{- else if .Values.shopsimulator.enabled -}}
{{- printf "http://%s:%d" (include "shopsimrl.componentName" (dict "ctx" . "component" "shopsimulator")) (int .Values.shopsimulator.port) -}}
{{- else -}}
{{- .Values.environment.baseUrl -}}
{{- end -}}
{{- end -}}

{{/*
Name of the environment variable carrying the model API key (skills mode: the analyst's).
Usage: include "shopsimrl.apiKeyEnv" .
*/}}
{{- define "shopsimrl.apiKeyEnv" -}}
{{- $fromConfig := "" -}}
{{- $cfg := fromYaml (include "shopsimrl.configYaml" .) -}}
{{- $section := ternary "analyst_model" "model" (eq .Values.mode "skills") -}}
{{- if kindIs "map" (get $cfg $section) -}}
{{- $fromConfig = get (get $cfg $section) "api_key_env" | default "" -}}
{{- end -}}
{{- .Values.model.apiKey.envName | default $fromConfig | default "OPENAI_API_KEY" -}}
{{- end -}}

{{/*
Environment of the containers that read and write the run (worker, reducer): the readiness
environment plus object storage. Secrets only by reference.
Usage: include "shopsimrl.runEnv" .
*/}}
{{- define "shopsimrl.runEnv" -}}
{{ include "shopsimrl.serviceEnv" . }}
{{- with .Values.storage.endpointUrl }}
- name: AWS_ENDPOINT_URL
  value: {{ . | quote }}
{{- end }}
{{- with .Values.storage.region }}
- name: AWS_DEFAULT_REGION
  value: {{ . | quote }}
{{- end }}
{{- with .Values.storage.credentials.existingSecret }}
- name: AWS_ACCESS_KEY_ID
  valueFrom:
    secretKeyRef:
      name: {{ . }}
      key: {{ $.Values.storage.credentials.accessKeyIdKey }}
- name: AWS_SECRET_ACCESS_KEY
  valueFrom:
    secretKeyRef:
      name: {{ . }}
      key: {{ $.Values.storage.credentials.secretAccessKeyKey }}
{{- end }}
{{- with .Values.worker.extraEnv }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{/*
Environment of the readiness init container, which only probes the model and ShopSimulator: no
object storage, so no S3 credentials.
Usage: include "shopsimrl.readinessEnv" .
*/}}
{{- define "shopsimrl.readinessEnv" -}}
{{ include "shopsimrl.serviceEnv" . }}
{{- with .Values.worker.extraEnv }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{/*
Environment every shopsimrl container of the run shares: run, config, service overrides and the
model key (the readiness probe lists the served models, which may need it).
Usage: include "shopsimrl.serviceEnv" .
*/}}
{{- define "shopsimrl.serviceEnv" -}}
- name: SHOPSIMRL_RUN
  value: {{ include "shopsimrl.runUri" . | quote }}
- name: SHOPSIMRL_CONFIG
  value: {{ printf "%s/%s" (include "shopsimrl.configDir" .) (include "shopsimrl.configFileName" .) | quote }}
- name: SHOPSIMRL_SHARDS
  value: {{ .Values.job.shards | quote }}
- name: SHOPSIMRL_PARALLELISM
  value: {{ include "shopsimrl.podsAtOnce" . | quote }}
- name: SHOPSIMRL_LOG_FORMAT
  value: {{ .Values.worker.logFormat | quote }}
{{- with include "shopsimrl.modelBaseUrl" . }}
- name: {{ get (dict "judge" "SHOPSIMRL_JUDGE_BASE_URL" "skills" "SHOPSIMRL_ANALYST_BASE_URL") $.Values.mode | default "SHOPSIMRL_MODEL_BASE_URL" }}
  value: {{ . | quote }}
{{- end }}
{{- /* skills: the failure analyst's live sessions need the shop as much as a rollout does. */}}
{{- with and (has $.Values.mode (list "rollout" "skills")) (include "shopsimrl.envBaseUrl" .) }}
- name: SHOPSIMRL_ENV_BASE_URL
  value: {{ . | quote }}
{{- end }}
{{- with .Values.model.apiKey.existingSecret }}
- name: {{ include "shopsimrl.apiKeyEnv" $ }}
  valueFrom:
    secretKeyRef:
      name: {{ . }}
      key: {{ $.Values.model.apiKey.key }}
{{- end }}
{{- end -}}

{{/*
The check of a ShopSimulator's readiness probes. body: an exec probe, `python3` from the image,
that needs "ready": true in the JSON of GET /healthz (any other answer, an HTTP error or no
answer fails it); status: an HTTP probe on /healthz (2xx/3xx passes), for images without
python3 whose /healthz answers non-2xx until ready. The port is the last argument.
Usage: include "shopsimrl.shopReadyCheck" (dict "check" "body" "port" 5700)
*/}}
{{- define "shopsimrl.shopReadyCheck" -}}
{{- if eq .check "body" -}}
exec:
  command:
    - python3
    - -c
    - |
      import json, sys, urllib.request
      try:
          with urllib.request.urlopen(f"http://127.0.0.1:{sys.argv[1]}/healthz", timeout=4) as answer:
              ready = json.load(answer).get("ready") is True
      except Exception:
          ready = False
      sys.exit(0 if ready else 1)
    - {{ .port | quote }}
timeoutSeconds: 5
{{- else -}}
httpGet:
  path: /healthz
  port: http
timeoutSeconds: 5
{{- end -}}
{{- end -}}

{{/*
worker.dnsConfig without its empty fields, as YAML; empty when nothing is left (null or {}).
Usage: include "shopsimrl.dnsConfig" .
*/}}
{{- define "shopsimrl.dnsConfig" -}}
{{- $dns := dict -}}
{{- range $key, $value := .Values.worker.dnsConfig -}}
{{- if $value -}}
{{- $_ := set $dns $key $value -}}
{{- end -}}
{{- end -}}
{{- with $dns -}}
{{- toYaml . -}}
{{- end -}}
{{- end -}}

{{/*
Pod-level security context of shopsimrl pods: non-root, fixed IDs, RuntimeDefault seccomp.
Usage: include "shopsimrl.podSecurityContext" .
*/}}
{{- define "shopsimrl.podSecurityContext" -}}
runAsNonRoot: true
runAsUser: {{ .Values.podSecurity.runAsUser }}
runAsGroup: {{ .Values.podSecurity.runAsGroup }}
fsGroup: {{ .Values.podSecurity.fsGroup }}
seccompProfile:
  type: RuntimeDefault
{{- end -}}

{{/*
Container security context of shopsimrl containers: read-only root, no privilege escalation,
no capabilities (Pod Security "restricted").
Usage: include "shopsimrl.containerSecurityContext" .
*/}}
{{- define "shopsimrl.containerSecurityContext" -}}
runAsNonRoot: true
allowPrivilegeEscalation: false
readOnlyRootFilesystem: true
capabilities:
  drop:
    - ALL
seccompProfile:
  type: RuntimeDefault
{{- end -}}

{{/*
Volume mounts of shopsimrl containers: the run config (and the inline split and skills files) into
the image's config directory, and the writable /tmp.
Usage: include "shopsimrl.configMounts" .
*/}}
{{- define "shopsimrl.configMounts" -}}
- name: config
  mountPath: {{ printf "%s/%s" (include "shopsimrl.configDir" .) (include "shopsimrl.configFileName" .) }}
  subPath: {{ include "shopsimrl.configFileName" . }}
  readOnly: true
{{- if not (kindIs "invalid" .Values.run.inlineSplitFile) }}
- name: config
  mountPath: {{ printf "%s/%s" (include "shopsimrl.configDir" .) (include "shopsimrl.inlineSplitRelPath" .) }}
  subPath: split.json
  readOnly: true
{{- end }}
{{- if not (kindIs "invalid" .Values.run.inlineSkillsFile) }}
- name: config
  mountPath: {{ printf "%s/%s" (include "shopsimrl.configDir" .) (include "shopsimrl.inlineSkillsRelPath" .) }}
  subPath: skills.json
  readOnly: true
{{- end }}
- name: tmp
  mountPath: /tmp
{{- end -}}

{{/*
Volumes of shopsimrl pods: the run's ConfigMap and the /tmp emptyDir.
Usage: include "shopsimrl.configVolumes" .
*/}}
{{- define "shopsimrl.configVolumes" -}}
- name: config
  configMap:
    name: {{ include "shopsimrl.configMapName" . }}
- name: tmp
  emptyDir:
    sizeLimit: {{ .Values.podSecurity.tmpSizeLimit }}
{{- end -}}

{{/*
Scheduling fields of worker-side pods (nodeSelector, tolerations, priority).
Usage: include "shopsimrl.scheduling" .
*/}}
{{- define "shopsimrl.scheduling" -}}
{{- with .Values.scheduling.nodeSelector }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .Values.scheduling.tolerations }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .Values.scheduling.priorityClassName }}
priorityClassName: {{ . }}
{{- end }}
{{- end -}}

{{/*
Secrets reach pods only by secretKeyRef. A user:password@ in any URL value, or a literal value
for a variable named like a credential, would be rendered in plain text into env vars, the
run-URI annotation, the ConfigMap and Helm's release Secret, readable by anyone who may read
those objects: refuse the render, naming the value and never repeating it. The CLI refuses such
URLs too (exit 2), but only once the pod runs.
Usage: include "shopsimrl.refuseCredentials" .
*/}}
{{- define "shopsimrl.refuseCredentials" -}}
{{- $v := .Values -}}
{{- $s3 := "S3 credentials go in a Secret named by storage.credentials.existingSecret" -}}
{{- $urls := list
      (list "model.baseUrl" $v.model.baseUrl "the API key goes in a Secret named by model.apiKey.existingSecret")
      (list "environment.baseUrl" $v.environment.baseUrl "ShopSimulator takes no credentials")
      (list "storage.endpointUrl" $v.storage.endpointUrl $s3)
      (list "storage.baseUri" $v.storage.baseUri $s3)
      (list "run.uri" $v.run.uri $s3) -}}
{{- range $urls -}}
{{- include "shopsimrl.refuseUrlCredentials" (dict "key" (index . 0) "value" (index . 1) "hint" (index . 2)) -}}
{{- end -}}
{{- $out := dict -}}
{{- include "shopsimrl.parseConfig" (dict "ctx" . "out" $out) -}}
{{- $found := dict "paths" (list) -}}
{{- include "shopsimrl.credentialUrlPaths" (dict "node" $out.cfg "path" "config" "out" $found) -}}
{{- range $key, $args := dict "vllm.extraArgs" $v.vllm.extraArgs "shopsimulator.args" $v.shopsimulator.args "shopsimulator.command" $v.shopsimulator.command "testbed.shop.extraArgs" $v.testbed.shop.extraArgs "testbed.policy.extraArgs" $v.testbed.policy.extraArgs -}}
{{- include "shopsimrl.credentialUrlPaths" (dict "node" $args "path" $key "out" $found) -}}
{{- end -}}
{{- with $found.paths -}}
{{- fail (printf "%s: a URL with user:password@ credentials would be rendered in plain text into the manifests; credentials go in Secrets, given by secretKeyRef (the CLI refuses such URLs too)" (first .)) -}}
{{- end -}}
{{- range $key, $env := dict "worker.extraEnv" $v.worker.extraEnv "shopsimulator.env" $v.shopsimulator.env -}}
{{- range $i, $e := $env -}}
{{- $named := printf "%s[%d] (%s)" $key $i (toString $e.name) -}}
{{- if and (kindIs "string" $e.value) (regexMatch (include "shopsimrl.credentialUrlPattern" $) $e.value) -}}
{{- fail (printf "%s: a URL with user:password@ credentials would be rendered in plain text into the manifests; put the whole value in a Secret and give it by valueFrom.secretKeyRef" $named) -}}
{{- end -}}
{{- if regexMatch "(?i)(^|[_.-])(API_?KEY|KEY|TOKEN|SECRET|PASSWORD|PASSWD|PWD|CREDENTIALS?|AUTH|AUTHORIZATION)([_.-]|$)" (toString $e.name) -}}
{{- if hasKey $e "value" -}}
{{- fail (printf "%s: a literal value for a credential would be rendered in plain text into the manifests; give it by valueFrom.secretKeyRef" $named) -}}
{{- else if and (kindIs "map" $e.valueFrom) (hasKey $e.valueFrom "configMapKeyRef") -}}
{{- fail (printf "%s: a credential from a ConfigMap is stored in plain text; give it by valueFrom.secretKeyRef" $named) -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/*
Regular expression of a URL with a userinfo part (scheme://user[:password]@host) anywhere in a
string; only the authority counts, so an '@' in a path (s3://bucket/ckpt@step100) is no match.
*/}}
{{- define "shopsimrl.credentialUrlPattern" -}}
(?i)[a-z][a-z0-9+.-]*://[^/?#\s@]*@
{{- end -}}

{{/*
Fails the render when one URL value carries credentials.
Usage: include "shopsimrl.refuseUrlCredentials" (dict "key" "model.baseUrl" "value" $url "hint" "…")
*/}}
{{- define "shopsimrl.refuseUrlCredentials" -}}
{{- if and (kindIs "string" .value) (regexMatch (include "shopsimrl.credentialUrlPattern" .) .value) -}}
{{- fail (printf "%s: a URL with user:password@ credentials would be rendered in plain text into the manifests; %s" .key .hint) -}}
{{- end -}}
{{- end -}}

{{/*
Collects the paths (config.model.base_url, vllm.extraArgs[1]) of every string under a value that
holds a URL with credentials, into the list "paths" of the dict passed as "out".
Usage: include "shopsimrl.credentialUrlPaths" (dict "node" .Values.config "path" "config" "out" $found)
*/}}
{{- define "shopsimrl.credentialUrlPaths" -}}
{{- if kindIs "map" .node -}}
{{- range $key, $child := .node -}}
{{- include "shopsimrl.credentialUrlPaths" (dict "node" $child "path" (printf "%s.%s" $.path $key) "out" $.out) -}}
{{- end -}}
{{- else if kindIs "slice" .node -}}
{{- range $i, $child := .node -}}
{{- include "shopsimrl.credentialUrlPaths" (dict "node" $child "path" (printf "%s[%d]" $.path $i) "out" $.out) -}}
{{- end -}}
{{- else if and (kindIs "string" .node) (regexMatch (include "shopsimrl.credentialUrlPattern" .) .node) -}}
{{- $_ := set .out "paths" (append .out.paths .path) -}}
{{- end -}}
{{- end -}}

{{/*
Checks of value combinations that a JSON schema cannot express; fails the render with the keys named.
Usage: include "shopsimrl.validate" .
*/}}
{{- define "shopsimrl.validate" -}}
{{- include "shopsimrl.refuseCredentials" . -}}
{{- if .Values.jobSet.enabled -}}
{{- if ne .Values.mode "rollout" -}}
{{- fail (printf "jobSet.enabled runs rollouts only: a %s release (mode: %s) uses the plain Jobs; set jobSet.enabled false" .Values.mode .Values.mode) -}}
{{- end -}}
{{- if and .Values.reducer.enabled .Values.reducer.watchWorkerJob -}}
{{- fail "reducer.watchWorkerJob has no use with jobSet.enabled: the JobSet creates the reducer only once every worker index has succeeded; set it false" -}}
{{- end -}}
{{- if not (regexMatch "^[a-z]" (include "shopsimrl.jobName" .)) -}}
{{- fail (printf "jobSet.enabled: the JobSet's name %s must start with a letter (JobSet names its Jobs and pods after it, as DNS-1035 labels); it comes from the release name and run.name" (include "shopsimrl.jobName" .)) -}}
{{- end -}}
{{- end -}}
{{- if not (kindIs "invalid" .Values.job.ttlSecondsAfterFinished) -}}
{{- fail "job.ttlSecondsAfterFinished: Helm owns the run's Jobs, and the next helm upgrade after a TTL deleted one would create it again (every shard pod and the reducer start over); set it to null: the Jobs go with helm uninstall (docs/kubernetes.md, \"Who owns the Jobs\")" -}}
{{- end -}}
{{- if and .Values.testbed.enabled (or .Values.vllm.enabled .Values.shopsimulator.enabled) -}}
{{- fail "testbed.enabled replaces the model and environment: turn off vllm.enabled and shopsimulator.enabled" -}}
{{- end -}}
{{- if and (not (kindIs "invalid" .Values.job.parallelism)) (gt (int .Values.job.parallelism) (int .Values.job.shards)) -}}
{{- fail (printf "job.parallelism (%d) exceeds job.shards (%d)" (int .Values.job.parallelism) (int .Values.job.shards)) -}}
{{- end -}}
{{- if and (not (kindIs "invalid" .Values.job.maxFailedIndexes)) (gt (int .Values.job.maxFailedIndexes) (int .Values.job.shards)) -}}
{{- fail (printf "job.maxFailedIndexes (%d) exceeds job.shards (%d)" (int .Values.job.maxFailedIndexes) (int .Values.job.shards)) -}}
{{- end -}}
{{- if and .Values.reducer.enabled .Values.reducer.watchWorkerJob (not .Values.reducer.serviceAccount.create) -}}
{{- $name := .Values.reducer.serviceAccount.name -}}
{{- if not $name -}}
{{- fail "reducer.serviceAccount.name: empty; with reducer.serviceAccount.create false, name the existing ServiceAccount the reducer alone runs as (the Role that may read the worker Job is bound to it)" -}}
{{- else if eq $name "default" -}}
{{- fail "reducer.serviceAccount.name must not be default: every pod of the namespace without its own ServiceAccount runs as default and would hold the reducer's rights; name one of the reducer's own, or set reducer.serviceAccount.create" -}}
{{- else if eq $name .Values.worker.serviceAccountName -}}
{{- fail "reducer.serviceAccount.name must not be worker.serviceAccountName: every worker pod would hold the rights to read the Job and list pods; name one of the reducer's own, or set reducer.serviceAccount.create" -}}
{{- end -}}
{{- end -}}
{{- if and .Values.reducer.enabled .Values.reducer.watchWorkerJob (not .Values.reducer.image.repository) -}}
{{- fail "reducer.watchWorkerJob needs the Kubernetes client, which the worker image leaves out: set reducer.image.repository to an image with the kube extra (make image-kube builds shopsimrl-kube)" -}}
{{- end -}}
{{- if and .Values.shopsimulator.enabled (or (not .Values.shopsimulator.image.repository) (not .Values.shopsimulator.image.tag)) -}}
{{- fail "shopsimulator.enabled needs shopsimulator.image.repository and shopsimulator.image.tag" -}}
{{- end -}}
{{- range .Values.shopsimulator.env -}}
{{- if eq (toString .name) "SHOPSIM_ENV_SLOTS" -}}
{{- fail "shopsimulator.env sets SHOPSIM_ENV_SLOTS; set shopsimulator.slots instead (the sizing check reads it)" -}}
{{- end -}}
{{- end -}}
{{- if and (eq .Values.mode "judge") .Values.readiness.enabled -}}
{{- /* Nothing to fail: readiness probes rollouts' services; the judge worker has no init container. */ -}}
{{- end -}}
{{- $slots := ternary "" (include "shopsimrl.shopSlots" .) (not (has .Values.mode (list "rollout" "skills"))) -}}
{{- if and $slots (eq .Values.mode "skills") -}}
{{- /* A skills worker is one process with up to experiment.concurrency live sessions (the failure analyst's), each holding a lease. */ -}}
{{- $pods := int (include "shopsimrl.podsAtOnce" .) -}}
{{- $concurrency := int (include "shopsimrl.configConcurrency" .) -}}
{{- if gt (mul $pods $concurrency) (int $slots) -}}
{{- fail (printf "%d worker pods at once × config experiment.concurrency %d = %d live sessions of the failure analyst exceed the %s ShopSimulator slots (%s): raise the slots, lower experiment.concurrency, or set job.parallelism" $pods $concurrency (mul $pods $concurrency) $slots (include "shopsimrl.shopSlotsKey" .)) -}}
{{- end -}}
{{- else if $slots -}}
{{- $pods := int (include "shopsimrl.podsAtOnce" .) -}}
{{- $loops := int .Values.worker.processes -}}
{{- $concurrency := int (include "shopsimrl.concurrency" .) -}}
{{- $inFlight := mul $pods $loops $concurrency -}}
{{- if gt $inFlight (int $slots) -}}
{{- $what := ternary (printf "%d worker pods at once × concurrency %d" $pods $concurrency) (printf "%d worker pods at once × %d processes × concurrency %d" $pods $loops $concurrency) (eq $loops 1) -}}
{{- fail (printf "%s = %d episodes in flight exceed the %s ShopSimulator slots (%s): raise the slots, lower worker.concurrency (or config experiment.concurrency), worker.processes, or set job.parallelism" $what $inFlight $slots (include "shopsimrl.shopSlotsKey" .)) -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/*
Worker pods running at once: job.parallelism, at most job.shards.
*/}}
{{- define "shopsimrl.podsAtOnce" -}}
{{- if kindIs "invalid" .Values.job.parallelism -}}
{{- .Values.job.shards -}}
{{- else -}}
{{- min (int .Values.job.parallelism) (int .Values.job.shards) -}}
{{- end -}}
{{- end -}}

{{/*
Worker pods the Job can create: one per shard plus its retries. `kubectl logs -l ... -f` follows
every pod the selector matches and refuses more than --max-log-requests (default 5) of them.
*/}}
{{- define "shopsimrl.workerPodsAtMost" -}}
{{- mul (int .Values.job.shards) (add1 (int .Values.job.backoffLimitPerIndex)) -}}
{{- end -}}

{{/*
Episodes in flight per worker: worker.concurrency, else the config's experiment.concurrency, else 1.
*/}}
{{- define "shopsimrl.concurrency" -}}
{{- if not (kindIs "invalid" .Values.worker.concurrency) -}}
{{- .Values.worker.concurrency -}}
{{- else -}}
{{- include "shopsimrl.configConcurrency" . -}}
{{- end -}}
{{- end -}}

{{/*
The config's experiment.concurrency, else 1 (a skills worker reads only this: SKILLS.yaml's
default is 4, so a skills config that leaves it out counts 4).
*/}}
{{- define "shopsimrl.configConcurrency" -}}
{{- $experiment := get (fromYaml (include "shopsimrl.configYaml" .)) "experiment" -}}
{{- if and (kindIs "map" $experiment) (hasKey $experiment "concurrency") -}}
{{- get $experiment "concurrency" -}}
{{- else if eq .Values.mode "skills" -}}
4
{{- else -}}
1
{{- end -}}
{{- end -}}

{{/*
Slots of the ShopSimulator the workers use, when the chart deploys it or is told; empty otherwise.
*/}}
{{- define "shopsimrl.shopSlots" -}}
{{- if .Values.testbed.enabled -}}
{{- .Values.testbed.shop.slots -}}
{{- else if .Values.shopsimulator.enabled -}}
{{- .Values.shopsimulator.slots -}}
{{- else if not (kindIs "invalid" .Values.environment.slots) -}}
{{- .Values.environment.slots -}}
{{- end -}}
{{- end -}}

{{- define "shopsimrl.shopSlotsKey" -}}
{{- if .Values.testbed.enabled -}}testbed.shop.slots{{- else if .Values.shopsimulator.enabled -}}shopsimulator.slots{{- else -}}environment.slots{{- end -}}
{{- end -}}
