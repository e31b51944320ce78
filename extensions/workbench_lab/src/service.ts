/**
 * WorkbenchService: the one place that talks to the server extension's REST API
 * (/workbench/api). Requests go through ServerConnection, so Jupyter's token and XSRF
 * headers are added exactly as for JupyterLab's own calls.
 */
import { URLExt } from '@jupyterlab/coreutils';
import { ServerConnection } from '@jupyterlab/services';

/** Which actions the installed workbench library supports (detected on the server). */
export interface ICapabilities {
  cancel: boolean;
  resume: boolean;
  snapshots: boolean;
  deploy: boolean;
  endpoints: boolean;
  stop_endpoint: boolean;
  tensorboard: boolean;
  /** Older servers: absent. */
  export?: boolean;
}

/** One run as the panel lists it: Job.summary() plus what the panel needs to draw it. */
export interface IRun {
  id: string;
  name: string;
  state: string | null;
  target: string;
  step: number | null;
  total_steps: number | null;
  first_loss: number | null;
  last_loss: number | null;
  eval_loss: number | null;
  tokens_per_s: number | null;
  elapsed_s: number | null;
  eta_s: number | null;
  error: string | null;
  /** Why a run stopped short and how to go on (a budget stop); absent from older servers. */
  note?: string | null;
  /** Why a queued job waits, as its scheduler says (Slurm's reason); older servers: absent. */
  queue_reason?: string | null;
  created: number;
  cost: number | null;
  /** The live projection at the measured pace, and the plan's figures (older servers: absent). */
  projected_total_s?: number | null;
  projected_total_range_s?: [number, number] | null;
  projected_cost?: number | null;
  projected_cost_range?: [number, number] | null;
  planned_total_s?: number | null;
  planned_cost?: number | null;
  budget_warning?: string | null;
  currency: string | null;
  /** The money as the library writes it (workbench.runs.money), by summary key: '0.42 CNY', or
   * only `cost`: 'free' / 'no price set' for a run that bills nothing (older servers: absent). */
  money?: Partial<Record<'cost' | 'planned_cost' | 'projected_cost' | 'projected_cost_range', string>>;
  /** [step, loss] pairs, downsampled on the server. */
  curve: [number, number][];
  /** The run folder relative to the file browser's root; null when outside it. */
  browse_path: string | null;
  has_tensorboard: boolean;
  /** The sweep this run is a trial of (absent from older servers, null for a plain run). */
  sweep?: { sweep: string; trial: number | null } | null;
  /** The settings that tell it from runs of the same name ("lr 0.003 · epochs 20"). */
  differs?: string | null;
  /** Its newest evaluation score ("heldout exact_match 0.633"). */
  score?: string | null;
}

/** A sweep (workbench.sweep): its trials are grouped under one row. */
export interface ISweep {
  id: string;
  name: string | null;
  state: string | null;
  objective: string | null;
  direction: string | null;
  trials_total: number | null;
  /** Trials that ran and ended. */
  trials_done: number;
  /** The sweep's ledger: final bills of ended trials plus the limits of running ones. */
  spent: number;
  /** What its trials under way hold (their limits): promised, not spent (older servers: absent). */
  held?: number | null;
  budget: number | null;
  currency: string | null;
  best: { trial: number; value: number | null; params: Record<string, unknown> } | null;
  /** Its trials' run ids, in trial order. */
  runs: string[];
  error: string | null;
}

export interface IMetricPoint {
  step: number;
  loss?: number;
  eval_loss?: number;
}

export interface ISnapshot {
  name: string;
  complete: boolean;
  latest: boolean;
  browse_path: string | null;
}

export interface IRunDetails extends IRun {
  run_dir: string;
  metrics: IMetricPoint[];
  log_names: string[];
  logs: string;
  /** Null when the library has no snapshots. */
  snapshots: ISnapshot[] | null;
  /** An export under way or done (null: none; older servers: absent). */
  export?: IExportState | null;
  /** The newest score of each task and metric, beside the base model's (older servers: absent). */
  scores?: IScore[];
  /** The knobs runs are compared by, as [label, value] rows, and the whole spec as YAML. */
  settings?: [string, string][];
  spec_yaml?: string;
}

/** A column of the comparison: a setting that differs, a result, or a score (and which way is better). */
export interface ICompareColumn {
  key: string;
  label: string;
  kind: 'setting' | 'result' | 'score' | 'base';
  better?: 'lower' | 'higher' | null;
}

/** Runs side by side (GET /workbench/api/compare?runs=ID,ID). */
export interface ICompareReply {
  columns: ICompareColumn[];
  rows: { id: string; name: string; state: string | null; values: (number | string | boolean | null)[] }[];
  curves: Record<string, [number, number][]>;
}

/** What Details shows of the run's export: under way, its last log lines, the last report. */
export interface IExportState {
  running: boolean;
  formats: string[] | null;
  report: { folders: Record<string, string>; checks: Record<string, unknown> } | null;
  log: string[];
}

/** One evaluation score of a run (eval.jsonl's newest line of its task), with the base's. */
export interface IScore {
  task: string;
  metric: string;
  value: number;
  base: number | null;
  n: number | null;
  step: number | null;
}

/** A deployed endpoint (workbench.serve): name, state, target, OpenAI base URL, models. */
export interface IEndpoint {
  name: string;
  state: string | null;
  target: string | null;
  url: string | null;
  models: string[];
  /** What the wallet still covers of it, or why a meter stopped it (older servers: absent). */
  money?: string | null;
}

/** The wallet every run, sweep, evaluation and endpoint draws from, in currency units. */
export interface IWallet {
  currency: string;
  balance: number;
  held: number;
  charged: number;
  credit: number;
  holds: { what: string; held: number; since: number }[];
  history: { at: number; kind: string; amount: number; note: string }[];
}

export interface IRunsReply {
  capabilities: ICapabilities;
  runs: IRun[];
  endpoints: IEndpoint[];
  /** Where runs can go and be served: "local" first, then targets.yaml (older servers: absent). */
  targets?: string[];
  /** Sweeps, newest first (older servers: absent). */
  sweeps?: ISweep[];
  /** The wallet, when one is set (older servers: absent). */
  wallet?: IWallet | null;
}

/** One student's account in currency units, as an instructor sees it. */
export interface ICourseStudent {
  student: string;
  balance: number;
  held: number;
  spent: number;
  granted: number;
  runs: number;
  running: number;
}

/** The course view (/workbench/api/course): empty outside a course hub. */
export interface ICourseReply {
  course: boolean;
  user?: string;
  instructor?: boolean;
  currency?: string;
  me?: { balance: number; held: number; spent: number; granted: number };
  students?: ICourseStudent[];
}

export type RunAction = 'cancel' | 'resume' | 'deploy' | 'export' | 'tensorboard';

export const TERMINAL_STATES = new Set([
  'succeeded',
  'failed',
  'cancelled',
  'budget_stopped',
  'pruned'
]);

/** A request the server refused, with the message the workbench library gave. */
export class WorkbenchRequestError extends Error {
  constructor(
    readonly status: number,
    message: string
  ) {
    super(message);
  }
}

export class WorkbenchService {
  constructor(
    private readonly settings: ServerConnection.ISettings = ServerConnection.makeSettings()
  ) {}

  listRuns(): Promise<IRunsReply> {
    return this.request<IRunsReply>('runs');
  }

  details(runId: string, tail = 200): Promise<IRunDetails> {
    return this.request<IRunDetails>(
      `runs/${encodeURIComponent(runId)}?tail=${tail}`
    );
  }

  logs(runId: string, name: string | null, tail = 200): Promise<{ text: string }> {
    const query = name ? `&name=${encodeURIComponent(name)}` : '';
    return this.request(`runs/${encodeURIComponent(runId)}/logs?tail=${tail}${query}`);
  }

  act(
    runId: string,
    action: RunAction,
    options?: Record<string, unknown>
  ): Promise<Record<string, unknown>> {
    return this.request(`runs/${encodeURIComponent(runId)}/${action}`, {
      method: 'POST',
      ...(options ? { body: JSON.stringify(options) } : {})
    });
  }

  stopEndpoint(name: string): Promise<Record<string, unknown>> {
    return this.request(`endpoints/${encodeURIComponent(name)}/stop`, { method: 'POST' });
  }

  newNotebook(directory: string, target: string): Promise<{ path: string }> {
    return this.request('notebooks', {
      method: 'POST',
      body: JSON.stringify({ directory, target })
    });
  }

  /** The runs side by side: differing settings first, scores, curves. */
  compare(runs: string[]): Promise<ICompareReply> {
    return this.request<ICompareReply>(`compare?runs=${runs.map(encodeURIComponent).join(',')}`);
  }

  /** A notebook whose first cell is `workbench.compare([...runs])`. */
  compareNotebook(directory: string, runs: string[]): Promise<{ path: string }> {
    return this.request('notebooks', {
      method: 'POST',
      body: JSON.stringify({ directory, runs })
    });
  }

  course(): Promise<ICourseReply> {
    return this.request<ICourseReply>('course');
  }

  grant(student: string, amount: number, note: string): Promise<ICourseReply> {
    return this.request<ICourseReply>('course/grant', {
      method: 'POST',
      body: JSON.stringify({ student, amount, note })
    });
  }

  private async request<T>(path: string, init: RequestInit = {}): Promise<T> {
    const url = URLExt.join(this.settings.baseUrl, 'workbench', 'api', path);
    let response: Response;
    try {
      response = await ServerConnection.makeRequest(url, init, this.settings);
    } catch (error) {
      throw new ServerConnection.NetworkError(error as TypeError);
    }
    const text = await response.text();
    let data: any = null;
    try {
      data = text ? JSON.parse(text) : null;
    } catch {
      data = null;
    }
    if (!response.ok) {
      const message =
        (data && (data.message || data.reason)) || response.statusText || text;
      throw new WorkbenchRequestError(response.status, String(message));
    }
    return data as T;
  }
}
