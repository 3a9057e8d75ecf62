{{/*
The specs of the run's two Jobs, shared by the plain Jobs (job-worker.yaml, job-reducer.yaml)
and the JobSet's replicated Jobs (jobset.yaml); they differ only where .Values.jobSet.enabled
says so.
*/}}

{{/*
Spec of the worker Job: an Indexed Job, pod N runs shard N (JOB_COMPLETION_INDEX).
Usage: include "shopsimrl.workerJobSpec" .
*/}}
{{- define "shopsimrl.workerJobSpec" -}}
{{- $shards := int .Values.job.shards -}}
completionMode: Indexed
completions: {{ $shards }}
parallelism: {{ .Values.job.parallelism | default $shards }}
backoffLimitPerIndex: {{ .Values.job.backoffLimitPerIndex }}
{{- if not (kindIs "invalid" .Values.job.maxFailedIndexes) }}
maxFailedIndexes: {{ .Values.job.maxFailedIndexes }}
{{- end }}
# A replacement pod starts only once the old one is gone: one writer per shard at a time
# within this Job. Across Jobs (a run.attempt bump) see docs/kubernetes.md, "Rerun".
podReplacementPolicy: Failed
podFailurePolicy:
  rules:
    # Evictions, preemptions and node drains are not the shard's fault: retry for free.
    - action: Ignore
      onPodConditions:
        - type: DisruptionTarget
          status: "True"
    {{- with .Values.job.failIndexExitCodes }}
    {{- $codes := . }}
    # Retrying these can never succeed (2: bad input, 42: run exists with another fingerprint).
    # A rule names one container, and wait-ready reads the same config: it exits 2 on the same
    # bad input before the worker ever starts, so it gets the same rule.
    {{- range $name := ternary (list "wait-ready" "worker") (list "worker") $.Values.readiness.enabled }}
    - action: FailIndex
      onExitCodes:
        containerName: {{ $name }}
        operator: In
        values:
          {{- toYaml $codes | nindent 10 }}
    {{- end }}
    {{- end }}
# No ttlSecondsAfterFinished: Helm owns this Job and would create it again, from scratch, on
# the next upgrade after a TTL deleted it (docs/kubernetes.md, "Who owns the Jobs").
{{- if not (kindIs "invalid" .Values.job.activeDeadlineSeconds) }}
activeDeadlineSeconds: {{ .Values.job.activeDeadlineSeconds }}
{{- end }}
{{- if not .Values.jobSet.enabled }}
suspend: {{ .Values.job.suspend }}
{{- end }}
template:
  metadata:
    labels:
      {{- include "shopsimrl.podLabels" (dict "ctx" . "component" "worker") | nindent 6 }}
      shopsimrl.io/run: {{ include "shopsimrl.runName" . | quote }}
      {{- with .Values.job.podLabels }}
      {{- toYaml . | nindent 6 }}
      {{- end }}
    annotations:
      # Evaluations must see the same config the Job was created with.
      checksum/config: {{ include "shopsimrl.configYaml" . | sha256sum }}
      {{- if .Values.job.doNotDisrupt }}
      karpenter.sh/do-not-disrupt: "true"
      {{- end }}
      {{- with .Values.job.podAnnotations }}
      {{- toYaml . | nindent 6 }}
      {{- end }}
  spec:
    restartPolicy: Never
    terminationGracePeriodSeconds: {{ .Values.worker.terminationGracePeriodSeconds }}
    automountServiceAccountToken: {{ .Values.worker.automountServiceAccountToken }}
    {{- with .Values.worker.serviceAccountName }}
    serviceAccountName: {{ . }}
    {{- end }}
    {{- with .Values.worker.imagePullSecrets }}
    imagePullSecrets:
      {{- range . }}
      - name: {{ . }}
      {{- end }}
    {{- end }}
    securityContext:
      {{- include "shopsimrl.podSecurityContext" . | nindent 6 }}
    {{- with include "shopsimrl.dnsConfig" . }}
    dnsConfig:
      {{- . | nindent 6 }}
    {{- end }}
    {{- with include "shopsimrl.scheduling" . }}
    {{- . | nindent 4 }}
    {{- end }}
    {{- with .Values.scheduling.affinity }}
    affinity:
      {{- toYaml . | nindent 6 }}
    {{- end }}
    {{- if .Values.readiness.enabled }}
    initContainers:
      # Bounded wait for the model to list the served model and ShopSimulator to be ready
      # (judge mode: the judge model only; skills mode: the analyst model, and the shop when
      # one is configured); exits 3 with a named reason on timeout instead of letting episodes
      # fail one by one.
      - name: wait-ready
        image: {{ include "shopsimrl.image" (dict "image" .Values.worker.image "defaultTag" .Chart.AppVersion) }}
        imagePullPolicy: {{ .Values.worker.image.pullPolicy }}
        args:
          {{- if eq .Values.mode "judge" }}
          - judge
          - wait-ready
          - $(SHOPSIMRL_CONFIG)
          - --timeout
          - {{ .Values.readiness.timeoutSeconds | quote }}
          {{- else if eq .Values.mode "skills" }}
          # A busy shop counts as ready here: other shards hold slots legitimately.
          - skills
          - wait-ready
          - $(SHOPSIMRL_CONFIG)
          - --timeout
          - {{ .Values.readiness.timeoutSeconds | quote }}
          {{- else }}
          - wait-ready
          - --config
          - $(SHOPSIMRL_CONFIG)
          - --timeout
          - {{ .Values.readiness.timeoutSeconds | quote }}
          # Other shards hold slots legitimately, and the worker releases a dead predecessor's
          # leases (its lease journal) only once it runs: a busy shop is not "not ready" here.
          - --no-require-free-slot
          {{- range .Values.run.overrides }}
          - --set
          - {{ . | quote }}
          {{- end }}
          {{- end }}
        env:
          {{- include "shopsimrl.readinessEnv" . | nindent 10 }}
        resources:
          {{- toYaml .Values.readiness.resources | nindent 10 }}
        securityContext:
          {{- include "shopsimrl.containerSecurityContext" . | nindent 10 }}
        volumeMounts:
          {{- include "shopsimrl.configMounts" . | nindent 10 }}
    {{- end }}
    containers:
      - name: worker
        image: {{ include "shopsimrl.image" (dict "image" .Values.worker.image "defaultTag" .Chart.AppVersion) }}
        imagePullPolicy: {{ .Values.worker.image.pullPolicy }}
        # The shard index is not passed: the worker reads JOB_COMPLETION_INDEX.
        args:
          {{- if eq .Values.mode "judge" }}
          - judge
          - worker
          - $(SHOPSIMRL_CONFIG)
          - --out
          - $(SHOPSIMRL_RUN)
          {{- else if eq .Values.mode "skills" }}
          - skills
          - worker
          - $(SHOPSIMRL_CONFIG)
          - --run
          - $(SHOPSIMRL_RUN)
          {{- else }}
          - worker
          - --run
          - $(SHOPSIMRL_RUN)
          - --config
          - $(SHOPSIMRL_CONFIG)
          {{- range .Values.run.overrides }}
          - --set
          - {{ . | quote }}
          {{- end }}
          {{- if .Values.run.finalTest }}
          - --final-test
          {{- end }}
          {{- if .Values.jobSet.enabled }}
          # The JobSet starts the reducer only once every index succeeded: a shard committed
          # with failed episodes (exit 1 otherwise) has done its part.
          - --succeed-once-committed
          {{- end }}
          {{- end }}
        env:
          {{- include "shopsimrl.runEnv" . | nindent 10 }}
          {{- with .Values.worker.concurrency }}
          - name: SHOPSIMRL_CONCURRENCY
            value: {{ . | quote }}
          {{- end }}
          - name: SHOPSIMRL_PROCESSES
            value: {{ .Values.worker.processes | quote }}
          - name: SHOPSIMRL_FLUSH_EPISODES
            value: {{ .Values.worker.flushEpisodes | quote }}
          - name: SHOPSIMRL_FLUSH_SECONDS
            value: {{ .Values.worker.flushSeconds | quote }}
        resources:
          {{- toYaml .Values.worker.resources | nindent 10 }}
        securityContext:
          {{- include "shopsimrl.containerSecurityContext" . | nindent 10 }}
        volumeMounts:
          {{- include "shopsimrl.configMounts" . | nindent 10 }}
    volumes:
      {{- include "shopsimrl.configVolumes" . | nindent 6 }}
{{- end -}}

{{/*
Spec of the reducer Job: reduce the run into summary.json.
Usage: include "shopsimrl.reducerJobSpec" .
*/}}
{{- define "shopsimrl.reducerJobSpec" -}}
backoffLimit: {{ .Values.reducer.backoffLimit }}
{{- if not .Values.jobSet.enabled }}
suspend: {{ .Values.job.suspend }}
{{- end }}
# The reducer's own --timeout ends it first; this only catches a hung process.
activeDeadlineSeconds: {{ add .Values.reducer.timeoutSeconds 3600 }}
podFailurePolicy:
  rules:
    - action: Ignore
      onPodConditions:
        - type: DisruptionTarget
          status: "True"
    # 1: summary.json is written (failed episodes or missing shards), 2/42: bad input. A retry
    # would write the same summary, after waiting out the whole timeout again; only 3 (store
    # down, interrupted, timed out without a partial summary) is worth retrying.
    - action: FailJob
      onExitCodes:
        containerName: reducer
        operator: In
        values: [1, 2, 42]
# No ttlSecondsAfterFinished: Helm owns this Job and would create it again, from scratch, on
# the next upgrade after a TTL deleted it (docs/kubernetes.md, "Who owns the Jobs").
template:
  metadata:
    labels:
      {{- include "shopsimrl.podLabels" (dict "ctx" . "component" "reducer") | nindent 6 }}
      shopsimrl.io/run: {{ include "shopsimrl.runName" . | quote }}
  spec:
    restartPolicy: Never
    # watchWorkerJob reads the worker Job through the API: that needs the token.
    automountServiceAccountToken: {{ or .Values.reducer.watchWorkerJob .Values.worker.automountServiceAccountToken }}
    {{- with include "shopsimrl.reducerServiceAccount" . }}
    serviceAccountName: {{ . }}
    {{- end }}
    {{- with .Values.worker.imagePullSecrets }}
    imagePullSecrets:
      {{- range . }}
      - name: {{ . }}
      {{- end }}
    {{- end }}
    securityContext:
      {{- include "shopsimrl.podSecurityContext" . | nindent 6 }}
    {{- with include "shopsimrl.dnsConfig" . }}
    dnsConfig:
      {{- . | nindent 6 }}
    {{- end }}
    {{- with include "shopsimrl.scheduling" . }}
    {{- . | nindent 4 }}
    {{- end }}
    containers:
      - name: reducer
        # The worker image, or with watchWorkerJob one that has the Kubernetes client.
        image: {{ include "shopsimrl.componentImage" (dict "ctx" . "image" .Values.reducer.image) }}
        imagePullPolicy: {{ default .Values.worker.image.pullPolicy .Values.reducer.image.pullPolicy }}
        args:
          {{- if eq .Values.mode "judge" }}
          - judge
          - reduce
          - $(SHOPSIMRL_RUN)
          - --wait
          - --timeout
          - {{ .Values.reducer.timeoutSeconds | quote }}
          {{- else if eq .Values.mode "skills" }}
          - skills
          - reduce
          - $(SHOPSIMRL_RUN)
          - --wait
          - --timeout
          - {{ .Values.reducer.timeoutSeconds | quote }}
          {{- else if .Values.jobSet.enabled }}
          # Started by the JobSet once every worker index succeeded: every shard is committed.
          - reduce
          - $(SHOPSIMRL_RUN)
          {{- else }}
          - reduce
          - $(SHOPSIMRL_RUN)
          - --wait
          - --timeout
          - {{ .Values.reducer.timeoutSeconds | quote }}
          {{- if .Values.reducer.partialOnTimeout }}
          - --partial-on-timeout
          {{- end }}
          {{- if .Values.reducer.watchWorkerJob }}
          - --worker-job
          - {{ include "shopsimrl.jobName" . }}
          - --namespace
          - {{ .Release.Namespace }}
          {{- end }}
          {{- end }}
        env:
          {{- include "shopsimrl.runEnv" . | nindent 10 }}
        resources:
          {{- toYaml .Values.reducer.resources | nindent 10 }}
        securityContext:
          {{- include "shopsimrl.containerSecurityContext" . | nindent 10 }}
        volumeMounts:
          {{- include "shopsimrl.configMounts" . | nindent 10 }}
    volumes:
      {{- include "shopsimrl.configVolumes" . | nindent 6 }}
{{- end -}}
